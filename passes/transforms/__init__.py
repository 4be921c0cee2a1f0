"""The graph-rewriting passes, in the order `passes.compile` runs them: route experts, propagate,
insert collectives (and group sibling products), localize, recompute; and `units`, which
`autopar.parallel.sharded` runs on a compiled program to make each repeated block one call."""
