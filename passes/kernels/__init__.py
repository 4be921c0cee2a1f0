"""Kernel specs: what each module the insertion pass puts in a graph is, how it is built and what one
training step of it costs (`spec`: SUMMA products, redistributions, gradient syncs; `local`: ops run on
their blocks, such as norms, embeddings and the vocab-parallel loss)."""
