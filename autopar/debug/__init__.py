"""Help when a parallel run misbehaves: `verify` (the parallel program against the unmodified model,
naming the first graph node that differs) and the pieces it is made of."""
