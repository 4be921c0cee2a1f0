"""The graph-rewriting passes, in the order `passes.compile` runs them: route experts, propagate,
insert collectives (and group sibling products), localize, recompute."""
