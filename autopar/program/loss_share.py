"""How a pipelined model's micro-batch losses add up to the whole batch's: each micro-batch's share,
read from the loss the model itself computes.

A mean loss over a batch is a sum over what it counts divided by how many it counts. Cut into m
micro-batches, the batch's mean is the micro-batches' means weighted by their shares of the count,
and the count is whatever the model's loss divides by: the targets that are not `ignore_index` for a
cross-entropy (a causal LM's labels after its one-token shift, a token classifier's labels, a
sequence classifier's one label per row), every element for an elementwise loss (MSE, BCE) or a
plain mean. So `loss_share` walks back from the loss output of the last stage's graph (torch's
`pipeline()` cut, before autopar compiles it) to the reduction that made it, and for a cross-entropy
copies the few nodes that compute its target from the model's inputs into a small program that
counts the targets of one micro-batch:

    share = loss_share(last_stage_gm, loss_index=0, inputs=["input_ids", "labels"])
    share.weights([{"labels": lb} for lb in labels.chunk(4)])   # e.g. tensor([0.25, 0.3125, 0.1875, 0.25])

(tests/test_pipeline.py runs it on a cut model).

Terms added to a counted loss (a mixture of experts' load-balancing loss) are weighed by its counts,
as gradient accumulation weighs them, and named in `others` (the caller warns: they are not one
process's on the whole batch). A loss it cannot read this way (two losses that each count targets, a
mean divided by a count the model is given) is refused with the op and source line, and the user
passes `target=` and `loss_fn=` instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.errors import UsageError
from passes.compat import is_fake, pytree
from passes.nodes import source_line
from passes.ops.verdicts import VERDICTS

__all__ = ["LossShare", "loss_leaf", "loss_share"]

aten = torch.ops.aten

# ops a loss passes through unchanged in its count: casts, copies, scalings by a constant
_THROUGH = {aten.alias.default, aten.clone.default, aten.contiguous.default, aten.to.dtype, aten.to.dtype_layout,
            aten.to.device, aten._to_copy.default, aten.squeeze.default, aten.detach.default}
_SCALED = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}
# losses with a target of class indices and an ignore_index: a mean counts the targets not ignored
_CLASS_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default,
                 aten.nll_loss2d.default}
# losses that average over every element of their input (with reduction=mean), and plain means
_ELEMENT_LOSSES = {aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default,
                   aten.huber_loss.default, aten.binary_cross_entropy.default,
                   aten.binary_cross_entropy_with_logits.default, aten.soft_margin_loss.default,
                   aten.kl_div.default, aten.hinge_embedding_loss.default, aten.margin_ranking_loss.default}
_MEAN, _SUM = 1, 2  # torch's Reduction enum


def loss_leaf(output) -> int | None:
    """The index, among the leaves of a model's output, of its loss: the first leaf if it is a 0-dim
    floating-point tensor (transformers' `loss` first), else the only such leaf; None without one."""
    scalars = [i for i, t in enumerate(pytree.tree_leaves(output))
               if isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point()]
    if scalars and scalars[0] == 0:
        return 0
    return scalars[0] if len(scalars) == 1 else None


@dataclass(frozen=True)
class LossShare:
    """What a micro-batch's mean loss weighs in the batch's: `kind` 'targets' (its counted targets over
    the batch's, counted by `program` from the model inputs `inputs`), 'elements' (equal shares: every
    micro-batch has as many elements) or 'sum' (a summed loss: each weighs 1)."""

    kind: str
    program: fx.GraphModule | None = None
    inputs: tuple = ()
    what: str = ""  # the loss, for messages ('cross_entropy_loss at model.py:12: ...')
    others: tuple = ()  # terms added to a counted loss and weighed by its counts (an auxiliary loss)

    def counts(self, feeds: list) -> torch.Tensor:
        """Each micro-batch's count, an int64 tensor [M] on the inputs' device (`feeds`: one dict of model
        inputs by name per micro-batch); never read on the host."""
        device = _device(feeds)
        if self.kind != "targets":
            return torch.ones(len(feeds), dtype=torch.int64, device=device)
        given = [[feed[k] for k in self.inputs] for feed in feeds]
        if any(is_fake(t) for args in given for t in args if isinstance(t, torch.Tensor)):
            # a step on fake tensors (`autopar.dry_run`): no values to count, equal shares
            return torch.ones(len(feeds), dtype=torch.int64, device=device)
        return torch.stack([self.program(*args).reshape(()).to(torch.int64) for args in given])

    def weights(self, feeds: list) -> torch.Tensor:
        """Each micro-batch's weight (float64 [M] on the inputs' device): its mean loss times it, summed, is the
        batch's loss. A batch or micro-batch that counts no target (0/0) is refused by a verdict read when the
        `checks` option says (`passes.ops.verdicts`): at once on the CPU, at the next call on an accelerator."""
        m, device = len(feeds), _device(feeds)
        if self.kind == "sum":
            return torch.ones(m, dtype=torch.float64, device=device)
        if self.kind == "elements":
            return torch.full((m,), 1 / m, dtype=torch.float64, device=device)
        counts = self.counts(feeds)
        VERDICTS.check(counts, lambda c: 0 not in c, self._empty)
        return counts.double() / counts.sum().clamp(min=1)

    def _empty(self, counts: list) -> UsageError:
        m = len(counts)
        if sum(counts) == 0:
            return UsageError(f"train_step: the loss ({self.what}) counts no target in this batch (every one is "
                              f"ignore_index), so it is 0/0; pass a batch with at least one counted target")
        # its own mean loss is 0/0: NaN in the sum, though one process's loss is defined
        return UsageError(f"train_step: micro-batch {counts.index(0)} of {m} counts no target in the loss "
                          f"({self.what}: every one is ignore_index); order or pad the batch so that each "
                          f"micro-batch counts one, or use fewer micro-batches")


def _device(feeds: list) -> torch.device:
    """The device of the first tensor among the micro-batches' inputs (the CPU when there is none)."""
    return next((t.device for feed in feeds for t in feed.values() if isinstance(t, torch.Tensor)),
                torch.device("cpu"))


def loss_share(gm: fx.GraphModule, loss_index: int, inputs: list) -> LossShare:
    """The share rule of the loss that `gm` (the last stage's graph, torch IR) returns as its output
    leaf `loss_index`. `inputs[i]` names placeholder i where it is a model input (None where it is a
    value from an earlier stage). Raises UsageError for a loss it cannot read."""
    out = next(iter(gm.graph.find_nodes(op="output")))
    return _share_of(gm, pytree.tree_leaves(out.args[0])[loss_index], inputs)


def _share_of(gm: fx.GraphModule, node, inputs: list) -> LossShare:
    while isinstance(node, fx.Node) and (node.target in _THROUGH or
                                         (node.target in _SCALED and not isinstance(node.args[1], fx.Node))):
        node = node.args[0]
    if isinstance(node, fx.Node) and node.target in (aten.add.Tensor, aten.add_.Tensor) and \
            all(isinstance(a, fx.Node) for a in node.args):
        return _sum_of(gm, node, inputs)
    if not isinstance(node, fx.Node) or node.op != "call_function":
        raise _unreadable(node, "it is not computed by an op of the last stage")
    args = _arguments(node)
    if node.target in (aten.mean.default, aten.mean.dim):
        return LossShare("elements", what=_describe(node))
    if node.target in (aten.sum.default, aten.sum.dim_IntList):
        return LossShare("sum", what=_describe(node))
    if node.target in _ELEMENT_LOSSES or node.target in _CLASS_LOSSES:
        reduction = args.get("reduction", _MEAN)
        if reduction == _SUM:
            return LossShare("sum", what=_describe(node))
        if reduction != _MEAN:
            raise _unreadable(node, f"its reduction is {reduction}, not a mean or a sum")
        if node.target in _ELEMENT_LOSSES or args["target"].meta["val"].is_floating_point():
            return LossShare("elements", what=_describe(node))  # probabilities as targets: a mean over rows
        if args.get("weight") is not None:
            raise _unreadable(node, "its class weights make each target count by its class")
        return _counting(gm, node, args["target"], args.get("ignore_index", -100), inputs)
    raise _unreadable(node, "it is not a mean, a sum or a loss function that autopar knows how to count")


def _sum_of(gm: fx.GraphModule, node: fx.Node, inputs: list) -> LossShare:
    """A loss that adds terms (a causal LM's cross-entropy plus a mixture of experts' load-balancing
    loss): the one term that counts targets sets the shares, the others are weighed by them, as
    gradient accumulation weighs them (named in `others`: they are not one process's on the whole
    batch). Two counted terms (a question-answering model's start and end losses), or none, are refused."""
    shares, unread = [], []
    for term in node.args:
        try:
            shares.append(_share_of(gm, term, inputs))
        except UsageError:
            unread.append(_describe(term))
    counted = [sh for sh in shares if sh.kind == "targets"]
    if len(counted) != 1:
        raise _unreadable(node, "it adds " + ("two losses that each count their own targets" if counted else
                                              "terms none of which counts targets"))
    rest = [sh.what for sh in shares if sh is not counted[0]] + unread
    return LossShare("targets", counted[0].program, counted[0].inputs, counted[0].what,
                     tuple(counted[0].others) + tuple(rest))


def _counting(gm: fx.GraphModule, loss: fx.Node, target: fx.Node, ignore_index: int, inputs: list) -> LossShare:
    """A program counting the targets `loss` does not ignore, from the model inputs `target` derives from."""
    needed, stack = {}, [target]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed[n] = True
        if n.op in ("call_module", "get_attr"):
            raise _unreadable(loss, f"its target depends on the model's weights ({n.target})")
        stack += n.all_input_nodes
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    names = []
    g = fx.Graph()
    env: dict = {}
    for i, p in enumerate(placeholders):
        if p in needed:
            if i >= len(inputs) or inputs[i] is None:
                raise _unreadable(loss, "its target depends on a value from an earlier stage")
            env[p] = g.placeholder(inputs[i])
            names.append(inputs[i])
    for n in gm.graph.nodes:
        if n in needed and n.op != "placeholder":
            env[n] = g.node_copy(n, lambda a: env[a])
    kept = g.call_function(aten.ne.Scalar, (env[target], ignore_index))
    g.output(g.call_function(aten.sum.default, (kept,)))
    return LossShare("targets", fx.GraphModule(torch.nn.Module(), g), tuple(names), _describe(loss))


def _arguments(node: fx.Node) -> dict:
    """The node's arguments by schema name, defaults included."""
    schema = node.target._schema
    out = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    out.update({a.name: v for a, v in zip(schema.arguments, node.args)})
    out.update(node.kwargs)
    if "self" in out and "input" not in out:
        out["input"] = out["self"]
    return out


def _describe(node) -> str:
    if not isinstance(node, fx.Node):
        return repr(node)
    where = source_line(node)
    return f"{getattr(node.target, '__name__', node.target)}" + (f" at {where}" if where else "")


def _unreadable(node, why: str) -> UsageError:
    return UsageError(f"pipeline train_step: cannot tell how the micro-batches' losses add up to the batch's: the "
                      f"model's loss ({_describe(node)}) is not one mean over what it counts ({why}). Pass "
                      f"target=... and loss_fn=fn to train_step, where fn(output, target) is a micro-batch's loss; "
                      f"the batch's loss is then the mean of the micro-batches'")
