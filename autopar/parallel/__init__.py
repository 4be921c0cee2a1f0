"""`parallelize` (`api`) and the `ParallelModule` it returns (`module`), which runs its programs
through `run` (eagerly or under torch.compile); what transformers' Trainer reads off one (`hf_compat`)."""
