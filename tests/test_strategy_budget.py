"""strategy='auto' stays bounded on any model: encoder-decoder stacks get one set of variables each and a
coordinate search whose number of estimates grows with the variables, not with their product; a time
budget stops it with the best plan found and a warning; an auto-planned BART matches one process."""

import math
import re

import pytest

from autopar.program.build import cache_off_kwargs, capture
from passes.search import strategy as S
from passes.options import Options
from tests import checks_hf
from tests.checks_strategy_budget import CPU, bart, bart_auto_parity
from tests.compare import assert_every_rank

CM = S.CostModel.from_dict(CPU)


def _graph(family):
    if family == "bart":
        model, kw = bart(meta=True)
    else:
        model, inputs = checks_hf.build(family)[:2]
        kw = inputs(4, 8, 1)
    return capture(model, (), {**cache_off_kwargs(model), **kw}).gm


def _variables(gm):
    units = S.find_units(gm)
    return units, list(dict.fromkeys(u.key for u in units)), {u.key: u.options for u in units}


def test_search_groups_follow_the_stacks():
    """Catches the variables of two stacks enumerated as one product (the former alternation took every
    block variable at once: 3^11 assignments per step for a 2+2-layer BART, which never finished), a
    group above GROUP assignments, and a window split that never enumerates two neighbours together."""
    keys = ([f"matmul:enc.layers.*.m{i}" for i in range(3)] + [f"matmul:dec.layers.*.m{i}" for i in range(7)]
            + ["embedding:enc.embed", "embedding:dec.embed", "matmul:head", "matmul:pool"])
    opts = {k: S.EMBED_OPTIONS if k.startswith("embedding") else S.OPTIONS for k in keys}
    groups = S.search_groups(keys, opts)
    assert sorted({k for g in groups for k in g}) == sorted(keys)
    for g in groups:
        assert math.prod(len(opts[k]) for k in g) <= S.GROUP, g
        assert len({k.split(".*")[0] if ".*" in k else None for k in g}) == 1, f"stacks mixed in {g}"
    dec = [k for k in keys if k.startswith("matmul:dec.")]
    for a, b in zip(dec, dec[1:]):
        assert any(a in g and b in g for g in groups), f"{a} and {b} never enumerated together: {groups}"


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_encoder_decoder_search_is_bounded(family):
    """Catches an exponential search on an encoder-decoder (tiny BART and T5 have 2.8 million
    assignments): it must finish with at most ROUNDS x GROUP estimates per variable, be no slower than
    fixed 2d or 1d, and end where no single unit's change is estimated faster."""
    gm = _graph(family)
    units, keys, opts = _variables(gm)
    bound = 2 + S.ROUNDS * S.GROUP * len(keys)
    assert math.prod(len(o) for o in opts.values()) > 100 * bound, "the model no longer tests a large space"
    c = S.choose(gm, (2, 2), CM, Options(search_budget=None))
    assert c.complete and c.evaluated <= bound, (c.evaluated, bound)
    assert c.estimate.time_s <= min(b.time_s for b in c.baselines.values()) * (1 + 1e-12)
    ev = S.Evaluator(gm, (2, 2), CM, units, Options())
    for k in keys:
        for o in opts[k]:
            moved = ev.estimate({**c.assignment, k: o}).time_s
            assert moved >= c.estimate.time_s * (1 - 1e-12), (k, o, moved, c.estimate.time_s)


def test_budget_stops_the_search_with_a_warning():
    """Catches a budget that is ignored, a stop without a warning, and a stop that returns something
    other than the best assignment evaluated (here: the faster of fixed 2d and fixed 1d)."""
    gm = _graph("bart")
    _units, keys, _opts = _variables(gm)
    with pytest.warns(S.SearchWarning, match=r"strategy search stopped at its time budget \(search_budget=0 s\) "
                      r"after 2 of 2834352 assignments: the plan uses the best found so far, estimated .* Pass a "
                      r"larger search_budget \(seconds; None: no limit\)"):
        c = S.choose(gm, (2, 2), CM, Options(search_budget=0))
    assert not c.complete and c.evaluated == 2
    fastest = min(c.baselines, key=lambda s: c.baselines[s].time_s)
    assert c.assignment == {k: fastest for k in keys}


def test_budget_messages_and_bad_budget(monkeypatch):
    """Every message of the budget: the progress note (once per search), the memory refusal that says the
    search stopped early, and a budget that is not a number of seconds."""
    gm = _graph("bart")
    monkeypatch.setattr(S, "PROGRESS_S", 0.0)
    monkeypatch.setattr(S, "ROUNDS", 1)
    with pytest.warns(S.SearchWarning) as rec:
        S.choose(gm, (2, 2), CM, Options(search_budget=None))
    notes = [str(w.message) for w in rec if "still running" in str(w.message)]
    assert len(notes) == 1, notes
    # the seconds are the machine's (0 on a quiet one, 1 under load): the rest of the note is exact
    assert re.match(r"strategy search still running after \d+ s: 2 of 2834352 assignments of 15 unit "
                    r"variables evaluated, best estimate so far", notes[0]), notes[0]
    assert notes[0].endswith("no time limit (search_budget=None)"), notes[0]
    with pytest.raises(MemoryError, match=r"the smallest estimate among 2 assignments is [0-9.]+ (B|KiB|MiB|GiB) "
                                          r"\(the search stopped at search_budget=0 s; a larger one may find one\)"):
        S.choose(gm, (2, 2), CM, Options(memory_limit=1.0, search_budget=0))
    for bad in (-1, "30", True):
        with pytest.raises(ValueError, match=r"search_budget=.*: expected seconds >= 0 \(e.g. 30\) or None for no "
                                             r"time limit"):
            Options(search_budget=bad)


def test_auto_planned_bart_matches_one_process(pool4):
    """Catches a wrong plan for an encoder-decoder chosen by the search (cross-attention reading the
    encoder output under a different unit's split, a 1d/rep choice mixed with 2d in one stack): logits,
    loss and every parameter gradient on every rank against the unmodified model."""
    res = pool4.run(bart_auto_parity, timeout=900)  # rank 0 searches, the others wait for its choice
    assert all(r["complete"] for r in res)
    assert len(set(res[0]["assignment"].values())) >= 2, f"the search chose one scheme only: {res[0]['assignment']}"
    assert all(r["assignment"] == res[0]["assignment"] for r in res), "ranks chose different plans"
    assert_every_rank([r["errs"] for r in res], "auto-planned BART at 2x2")
