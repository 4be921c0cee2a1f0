"""The benchmarks behind `python -m autopar bench`: one module per benchmark, shared helpers in `common`."""
