"""The one parse of a run's shape (`autopar.program.spec`): each form of grid, pipeline and strategy is
accepted or refused the same way by every entry point, and an estimate's dimensions become the keywords
parallelize builds them with. Single process, no process group."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.errors import UsageError
from autopar.program.pipe import Pipeline
from autopar.program.spec import parse_spec, spec_of_dimensions
from passes.cost.step import Parallel


def test_each_grid_form():
    two = parse_spec((2, 4))
    assert (two.grid, two.dp, two.mesh, two.world, two.cube, two.handshake) == ((2, 4), 1, (2, 4), 8, False, (2, 4))
    rep = parse_spec([3, 2, 2], data_parallel="shard")
    assert (rep.grid, rep.dp, rep.mesh, rep.world) == ((3, 2, 2), 3, (2, 2), 12)
    cube = parse_spec((2, 2, 2), strategy="3d")
    assert (cube.dp, cube.mesh, cube.world, cube.cube) == (1, (2, 4), 8, True)
    piped = parse_spec((1, 2), pipeline=3)
    assert piped.pipeline == Pipeline(stages=3) and piped.stages == 3 and piped.world == 6
    assert piped.handshake == ((1, 2), Pipeline(stages=3))
    count = parse_spec(8, strategy="auto")
    assert (count.grid, count.devices, count.world, count.handshake) == (None, 8, 8, 8)
    arranged = count.arranged((2, 2, 2), "3d")
    assert (arranged.grid, arranged.devices, arranged.cube, arranged.dp, arranged.mesh) == ((2, 2, 2), None, True, 1,
                                                                                            (2, 4))


@pytest.mark.parametrize("kwargs, words", [
    ({"grid": (2, 0)}, r"grid=\(2, 0\): expected \(R, C\) of positive ints"),
    ({"grid": (2, 2, 2, 2)}, r"expected \(R, C\) of positive ints"),
    ({"grid": (2, True)}, r"expected \(R, C\) of positive ints"),
    ({"grid": "2x2"}, r"expected \(R, C\) of positive ints"),
    ({"grid": 8}, "needs strategy='auto'"),
    ({"grid": 8, "strategy": "auto", "pipeline": 2}, "with pipeline stages"),
    ({"grid": 0, "strategy": "auto"}, "a device count must be a positive int"),
    ({"grid": (2, 2), "pipeline": "two"}, "pipeline='two': expected None, a number of stages"),
    ({"grid": (2, 2), "pipeline": 1}, r"Pipeline\(stages=1\): expected an int >= 2"),
    ({"grid": (2, 4), "strategy": "3d"}, "3D tensor parallelism runs on a cube"),
    ({"grid": (2, 2, 2), "strategy": "3d", "data_parallel": "shard"}, "and data_parallel='shard'"),
    ({"grid": (2, 2, 2), "strategy": "3d", "pipeline": 2}, "and pipeline stages"),
])
def test_each_refusal_says_what_would_work(kwargs, words):
    grid = kwargs.pop("grid")
    with pytest.raises(UsageError, match=words) as e:
        parse_spec(grid, who="autopar.somewhere", **kwargs)
    assert str(e.value).startswith("autopar.somewhere: ") or "Pipeline(" in str(e.value)


@pytest.mark.parametrize("grid, extra, words", [
    ((2, 0), {}, r"grid=\(2, 0\): expected \(R, C\) of positive ints"),
    (8, {}, "needs strategy='auto'"),
    ((2, 4), {"strategy": "3d"}, "3D tensor parallelism runs on a cube"),
    ((2, 2), {"pipeline": "two"}, "pipeline='two': expected None, a number of stages"),
])
def test_plan_dry_run_and_parse_agree(grid, extra, words):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)
    for who, call in (("autopar.parse", lambda: parse_spec(grid, who="autopar.parse", **extra)),
                      ("autopar.plan", lambda: autopar.plan(model, grid=grid, example_inputs=(x,), **extra)),
                      ("autopar.dry_run", lambda: autopar.dry_run(model, grid=grid, example_inputs=(x,), **extra))):
        with pytest.raises(UsageError, match=words) as e:
            call()
        assert who in str(e.value), (who, str(e.value))


def test_dimensions_become_parallelize_keywords():
    assert spec_of_dimensions(Parallel(tp=(8,), dp_shard=32)).kwargs() == {
        "grid": (32, 1, 8), "strategy": "1d", "data_parallel": "shard"}
    assert spec_of_dimensions(Parallel(tp=(2, 4), dp_replicate=2)).kwargs() == {
        "grid": (2, 2, 4), "strategy": "2d", "data_parallel": "replicate"}
    assert spec_of_dimensions(Parallel(tp=(2, 2, 2))).kwargs() == {"grid": (2, 2, 2), "strategy": "3d"}
    piped = spec_of_dimensions(Parallel(tp=(8,), dp_shard=8, pp=8, schedule="interleaved_1f1b", microbatches=16,
                                        interleave=2)).kwargs()
    assert piped == {"grid": (8, 1, 8), "strategy": "1d", "data_parallel": "shard",
                     "pipeline": Pipeline(stages=8, schedule="interleaved_1f1b", microbatches=16,
                                          stages_per_rank=2)}
    with pytest.raises(UsageError, match="HSDP"):
        spec_of_dimensions(Parallel(tp=(8,), dp_shard=4, dp_replicate=2))
    with pytest.raises(UsageError, match="runs without replicas"):
        spec_of_dimensions(Parallel(tp=(2, 2, 2), dp_shard=2))
