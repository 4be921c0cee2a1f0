# `make demo` and `make test` work on a fresh machine: they create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-0.1.0-hf
PLOT_STAMP := $(VENV)/.installed-0.1.0-plot  # matplotlib, for the targets that draw

.PHONY: demo test test-all test-compat gpu-check lint docs bench bench-load bench-plan bench-compare bench-strategy bench-debug bench-dry-run bench-overlap bench-context hf-example sweep-hf clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build on CPU machines
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,hf,lint,docs]'
	touch $(STAMP)

$(PLOT_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[plot]'
	touch $(PLOT_STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# lint and the docs first: they take seconds, the suite minutes. pytest's paths and --doctest-modules are in
# pyproject.toml. Two pytest workers, each test file whole on one (its pool of ranks kept warm): the suite's own
# processes leave a core idle while a check waits on a timeout, a spawn or one busy rank (XDIST=0: one process)
XDIST ?= 2
PYTEST_WORKERS := $(if $(filter 0,$(XDIST)),,-n $(XDIST) --dist loadfile)
test: lint docs
	$(BIN)/python -m pytest -q $(PYTEST_WORKERS)

# the slow tier too: exhaustive sweeps, every grid, long compiled runs (see README, Contributing)
test-all: lint docs
	RUN_SLOW=1 $(BIN)/python -m pytest -q $(PYTEST_WORKERS)

# the oldest torch autopar supports (pyproject.toml), in a venv of its own: PyPI's 2.11.0 is a CUDA build
# (about 4.7 GB installed, a minute to fetch here); a parity subset runs on the CPU under it
COMPAT_TORCH := 2.11.0
COMPAT := .venv-compat
COMPAT_TESTS := tests/test_engine_parity.py tests/test_api_guards.py tests/test_device.py tests/test_gpu_check.py \
	tests/test_sharded.py
$(COMPAT)/.installed-$(COMPAT_TORCH): pyproject.toml
	test -x $(COMPAT)/bin/python || $(PY) -m venv $(COMPAT)
	$(COMPAT)/bin/pip install -q torch==$(COMPAT_TORCH)
	$(COMPAT)/bin/pip install -q -e '.[test,hf]'
	touch $@

test-compat: $(COMPAT)/.installed-$(COMPAT_TORCH)
	$(COMPAT)/bin/python -m pytest -q -p no:cacheprovider $(COMPAT_TESTS)

# the first-GPU check: nothing but torch needed (autopar from this tree); writes gpu_check.json
gpu-check:
	PYTHONPATH=. $(PY) examples/gpu_check.py --out gpu_check.json

# ruff and mypy, configured (and the choice of rules explained) in pyproject.toml
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m mypy

# the user guide and the API reference (from the docstrings) into site/; strict (mkdocs.yml): a broken
# link, anchor or reference fails it
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(BIN)/python examples/bench_lowering.py

bench-load: $(STAMP)
	$(BIN)/python examples/bench_load.py

bench-compare: $(PLOT_STAMP)
	$(BIN)/python -m autopar bench --plot docs/bench.png

bench-strategy: $(STAMP)
	$(BIN)/python examples/bench_strategy.py

# the flight recorder and autopar.report against the recorder off, per training step
bench-debug: $(STAMP)
	$(BIN)/python examples/bench_debug.py

# overlap=True against every transfer in line: step time and exposed communication (torch.profiler) at 2D 2x2
# (each lowering), 1D 1x4, 3D 2x2x2, with torchtitan's TP 4 + SP plan beside them (docs/benchmarks.md, Overlap)
bench-overlap: $(STAMP)
	$(BIN)/python examples/bench_overlap.py

# context_parallel at sequence 16,384: activations saved per rank and bytes against one process (docs/benchmarks.md)
bench-context: $(STAMP)
	$(BIN)/python examples/bench_context.py

# autopar.dry_run of a Llama-3-70B shape at 64, 512 and 4,096 ranks: seconds and peak RSS each
bench-dry-run: $(STAMP)
	$(BIN)/python examples/bench_dry_run.py

bench-plan: $(STAMP)
	$(BIN)/python examples/bench_plan.py

hf-example: $(STAMP)
	$(BIN)/python examples/hf_causal_lm.py

sweep-hf: $(STAMP)
	$(BIN)/python examples/sweep_hf.py --out docs/models.md

clean:
	rm -rf $(VENV) build site *.egg-info .mypy_cache .ruff_cache
