"""`parallelize` and the `ParallelModule` it returns (`module`), and what transformers' Trainer reads
off one (`hf_compat`)."""
