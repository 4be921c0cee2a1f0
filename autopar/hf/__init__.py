"""transformers integration: `ParallelTrainer` (`trainer`)."""
