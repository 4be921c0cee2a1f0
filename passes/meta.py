"""The `node.meta` keys autopar writes, each defined once: the passes hand their results to the next
pass (and to `autopar.explain`, `plan` and the tests) through these entries, so writer and reader
name the same constant instead of spelling the string. The values start with `autopar_` to keep
clear of torch's own keys (`val`, `nn_module_stack`, `stack_trace`); graphs saved or printed
elsewhere may be read by those strings, so they do not change.

Each entry: the value, on which nodes, written by -> read by.

- `ROLE`: `'param'`, `'buffer'`, `'constant'` or `'input'`, on placeholders. capture -> propagate,
  strategy, estimate, cost, functionalize.
- `PARAM`: a parameter's canonical name (a tied weight's first name), on its placeholder.
  capture -> propagate, rules.matmul.
- `REGION`: the call an inlined grad-mode / autocast region came from (nested ones joined by `/`),
  on the region's nodes. regions (carried by functionalize) -> insert_collectives.
- `CHOICE`: `'2d'`, `'1d'` or `'rep'`, on the nodes of each unit. strategy.choose / strategy.fixed
  -> propagate, rules.matmul, rules.embedding_loss.
- `CHOICE_WHY`: (the option chosen, {option: estimated seconds, None where it did not fit}), on the
  nodes of each unit. strategy.choose -> autopar.explain.
- `LOWERING`: the SUMMA lowering the estimate priced, on matmul nodes. strategy.choose, lowering.pick_lowerings ->
  kernelspec (when insert_collectives builds the kernel).
- `LAYOUT`: a Layout (a tuple of them for multi-output ops), on every node. propagate, and
  insert_collectives for the nodes it adds -> insert_collectives, localize, kernelspec, cost, autopar.
- `STRATEGY`: the rule's Strategy, on call nodes. propagate -> insert_collectives, estimate,
  autopar.explain (inserted kernels keep the strategy of the node they replace).
- `PLACED`: a Layout fixed before propagation, on buffer placeholders each rank holds only its block
  of (a generation KV cache: batch over rows, KV heads over columns). autopar.generate -> propagate.
- `INSERTED`: True, on Redistribute and GradSync nodes. insert_collectives -> insert_collectives
  (which skips them), autopar.explain.
- `KERNEL`: the KernelSpec, on every module node insert_collectives adds. insert_collectives ->
  cost, autopar.explain.
- `RECOMPUTE`: the name of the `Recompute` module whose region holds the node, on the nodes of the
  flat graph `recompute` grouped (recompute=... only). recompute -> autopar.explain, autopar.plan.
- `PLAN_ARGS`: the args grid position (0, 0) bakes, on the sized nodes whose args this rank bakes
  otherwise (its torch.chunk block of a dim the grid does not divide). localize -> autopar.program.guards
  (ranks compare one plan).
- `CAPTURED_AS`: the op capture recorded (`aten.view.default`), on the views localize turned into
  `aten.reshape.default`. localize -> the rule oracle (tests/test_rules_oracle.py names the rule that ran).

>>> import torch
>>> from passes.capture.export import capture
>>> cap = capture(torch.nn.Linear(4, 2), (torch.randn(2, 4),))
>>> [(n.name, n.meta[ROLE], n.meta.get(PARAM)) for n in cap.gm.graph.find_nodes(op="placeholder")]
[('p_weight', 'param', 'weight'), ('p_bias', 'param', 'bias'), ('input', 'input', None)]
"""

ROLE = "autopar_role"
PARAM = "autopar_param"
REGION = "autopar_region"
CHOICE = "autopar_choice"
CHOICE_WHY = "autopar_choice_why"
LOWERING = "autopar_lowering"
LAYOUT = "autopar_layout"
STRATEGY = "autopar_strategy"
INSERTED = "autopar_inserted"
KERNEL = "autopar_kernel"
PLACED = "autopar_placed"
RECOMPUTE = "autopar_recompute"
PLAN_ARGS = "autopar_plan_args"
CAPTURED_AS = "autopar_captured_as"
