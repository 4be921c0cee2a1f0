"""The command line a user meets first: quick help, help for every flag, one grid syntax, optional
dependencies checked before the work starts, transformers' refusals as one line."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from autopar import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_LLAMA = ["--set", "num_hidden_layers=1", "--set", "vocab_size=256", "--batch", "2", "--seq", "8"]


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["inspect", "--help"], ["calibrate", "--help"]])
def test_help_does_not_import_torch(argv):
    """`autopar --help` took 5 s: the package and the CLI imported torch before parsing a flag."""
    code = ("import sys; from autopar.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]")
    r = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "usage: autopar" in r.stdout


def test_every_flag_has_help():
    """`bench --rounds/--steps/--json` showed no help text."""
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        for action in parser._actions:
            assert action.help, f"autopar {name} {'/'.join(action.option_strings) or action.dest}: no help text"


def test_grid_syntax_is_rxc_everywhere(capsys):
    """`calibrate --grid R C` and `inspect --grid RxC` differed; both read RxC, calibrate still reads
    its older `R C`, and anything else is a usage error naming the flag and the form expected."""
    parser = cli.build_parser()
    assert parser.parse_args(["inspect", "gpt2", "--grid", "2x4"]).grid == (2, 4)
    assert parser.parse_args(["inspect", "gpt2", "--grid", "auto"]).grid == "auto"
    assert parser.parse_args(["inspect", "gpt2"]).grid == (2, 2)
    for words in (["2x4"], ["2X4"], ["2", "4"]):
        assert cli.calibrate_grid(parser, words) == (2, 4), words
    for argv, why in ((["inspect", "gpt2", "--grid", "2by2"], "'2by2': expected RxC, e.g. 2x2 or 1x4"),
                      (["inspect", "gpt2", "--grid", "0x2"], "'0x2': both R and C must be positive"),
                      (["calibrate", "--grid", "2", "2", "2"], "'2 2 2': expected RxC"),
                      (["calibrate", "--grid", "2,2"], "'2,2': expected RxC")):
        with pytest.raises(SystemExit):
            cli.main(argv)
        err = capsys.readouterr().err
        assert "argument --grid: " + why in err, (argv, err)


@pytest.mark.parametrize("argv", [["bench", "--plot", "out.png"], ["inspect", "gpt2", "--plot", "out.png"]])
def test_plot_without_matplotlib_fails_first(argv, monkeypatch):
    """`bench --plot` ran for minutes, then died with ModuleNotFoundError: matplotlib."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.delitem(sys.modules, "autopar.bench.compare", raising=False)  # what `bench` measures with
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert f"autopar {argv[0]} --plot needs matplotlib" in str(e.value)
    assert "pip install 'autopar[plot]'" in str(e.value)
    # nothing measured before the check (the parser's own `autopar.bench.args` may be loaded: it measures nothing)
    assert "autopar.bench.compare" not in sys.modules


@pytest.mark.parametrize("model,sets,why", [
    ("llama", ["hidden_size=99"], "The hidden size (99) is not a multiple of the number of attention heads (32)"),
    ("gpt2", ["n_embd=99", "n_layer=1"], "`embed_dim` must be divisible by num_heads (got `embed_dim`: 99"),
    ("gpt2", ["n_layer=abc"], "'n_layer' expected int, got str"),
])
def test_bad_config_value_is_one_line(model, sets, why):
    """`inspect --set hidden_size=99` printed transformers' 11-frame traceback."""
    argv = ["inspect", model, *SMALL_LLAMA[2:4]] if model == "gpt2" else ["inspect", model, *SMALL_LLAMA]
    for kv in sets:
        argv += ["--set", kv]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"autopar inspect: {model} rejects "), msg
    assert sets[0].replace("=abc", '="abc"') in msg and why in msg, msg


def test_inspect_of_your_own_module_prices_1d_from_its_graph(capsys):
    """A plain nn.Module has no `config`: `--vs 1d` crashed formatting a None ratio and `--sweep` priced
    1D at 0 bytes. Its layers, hidden size and tokens now come from the captured graph and the example
    batch: 3 blocks of hidden 32 on 4 x 8 tokens, two Megatron all-reduces of [32 tokens, 32] forward
    and two backward per block plus one, each a ring all-reduce receiving 2 (p-1)/p of 4096 bytes."""
    own = ["inspect", "tests.cli_own_model:build", "--grid", "2x2"]
    assert cli.main(own + ["--vs", "1d"]) == 0
    text = capsys.readouterr().out
    assert "1D (Megatron-style) at p=4: 0.1 MiB received per rank per step" in text, text
    assert cli.main(own + ["--vs", "1d", "--sweep", "9", "--json"]) == 0
    import json

    report = json.loads(capsys.readouterr().out)
    ring = 2 * 3 / 4 * (32 * 32 * 4)
    assert report["vs_1d"]["comm_bytes_per_rank_per_step"] == 3 * 4 * ring + ring, report["vs_1d"]
    assert report["vs_1d"]["ratio_2d_over_1d_comm"] > 0, report["vs_1d"]
    rows = [r for r in report["sweep"] if "p" in r]
    assert [r["p"] for r in rows] == [4, 9] and all(r["1d_comm_bytes"] > 0 for r in rows), rows


def test_inspect_says_why_each_op_fell_back(capsys):
    """The fallback column listed `diff` and `pad` with no reason: each fallback now gets a line saying
    where it is and why it runs whole."""
    assert cli.main(["inspect", "tests.cli_own_model:build_with_fallback", "--grid", "2x2"]) == 0
    text = capsys.readouterr().out
    assert "costly fallbacks: diff" in text, text
    assert "  diff (aten.diff.default) in <top> runs whole: fallback: no sharding rule for aten.diff.default" \
        in text, text


def test_inspect_plans_pipeline_stages(capsys):
    """`--pipeline 2 --stages-per-rank 2` on a 4-layer Llama: four stages of one layer, two per pipeline
    rank, looped; the interleaved bubble (S-1)/(V*M+S-1) with M = 4; `--cluster` names the preset."""
    argv = ["inspect", "llama", "--set", "num_hidden_layers=4", "--set", "vocab_size=256", "--batch", "8", "--seq",
            "8", "--grid", "1x2", "--pipeline", "2", "--schedule", "interleaved_1f1b", "--stages-per-rank", "2",
            "--microbatches", "4", "--cluster", "dgx-h100", "--json"]
    assert cli.main(argv) == 0
    import json

    report = json.loads(capsys.readouterr().out)
    assert [s["layers"] for s in report["per_stage"]] == [[f"model.layers.{i}"] for i in range(4)], report
    assert [r["stages"] for r in report["per_rank"]] == [[0, 2], [1, 3]], report["per_rank"]
    assert abs(report["bubble"] - 1 / 9) < 1e-12 and "dgx-h100" in report["cost_source"], report


def test_inspect_chooses_a_pipeline(capsys):
    """`--pipeline auto --devices 4` (issue 50, item 8: no command line reached choose_pipeline): every
    layout tried is a line, fastest first, and the chosen plan follows; without --devices it says what
    it needs."""
    argv = ["inspect", "llama", "--set", "num_hidden_layers=2", "--set", "vocab_size=256", "--batch", "4", "--seq",
            "8", "--pipeline", "auto", "--devices", "4"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    tried = [ln for ln in text.splitlines() if " stages x " in ln and "step " in ln]
    steps = [float(ln.split("step ")[1].split(" ms")[0]) for ln in tried]
    assert tried and steps == sorted(steps), text
    assert "\nchosen:\npipeline 2 x grid" in text, text
    with pytest.raises(SystemExit, match="needs --devices N"):
        cli.main(argv[:-2])


def test_inspect_dry_run(capsys):
    """`--dry-run all` on a 2x2 grid of a one-block Llama built on the meta device (its blocks allocated,
    its rotary tables restored): each rank's program stepped under the fake process group, the checks'
    verdict, every rank's grid bytes equal to its plan's, in JSON."""
    import json

    argv = ["inspect", "llama", "--set", "num_hidden_layers=1", "--set", "hidden_size=32", "--set",
            "num_attention_heads=4", "--set", "num_key_value_heads=4", "--set", "vocab_size=128",
            "--set", "intermediate_size=64", "--batch", "4", "--seq", "8", "--grid", "2x2", "--dry-run", "all",
            "--json"]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["checks"].startswith("passed"), report["checks"]
    assert sorted(report["ranks"]) == ["0", "1", "2", "3"], sorted(report["ranks"])
    for rank, r in report["ranks"].items():
        assert r["agrees"] and r["bytes"]["grid"] == r["planned"] > 0, (rank, r["bytes"], r["planned"])
