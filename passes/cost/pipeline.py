"""What a pipeline schedule leaves idle: the estimated bubble, as a share of the step.

With S pipeline ranks, M micro-batches and V stages per rank, and every stage taking the same time,
a rank works V*M chunk-times (one chunk-time: one stage's forward and backward of one micro-batch)
and waits the rest:

- 'gpipe' and '1f1b' (V = 1): S-1 chunk-times of fill and drain, a share (S-1)/(M+S-1) of the step
  (GPipe, Huang et al. 2019; 1F1B has the same bubble and holds S micro-batches instead of M,
  Narayanan et al. 2021).
- 'interleaved_1f1b' and 'looped_bfs': the fill and drain pass through stages V times smaller,
  (S-1)/(V*M+S-1) (Narayanan et al. 2021, section 2.2; breadth-first has the same bubble with V*M
  micro-batch stages in flight, Lamy-Poirier 2023).
- the zero-bubble schedules ('interleaved_zero_bubble', 'zbv_zero_bubble', 'dualpipev') fill the
  drain with the weight-gradient halves of the backward: ZB-H1's bubble, a third of 1F1B's where
  forward, input-gradient and weight-gradient take equal time (Qi et al. 2023), (S-1)/3 chunk-times.
  The V-shaped ones reach less when M >= 2S; a third is the estimate used here.
"""

from __future__ import annotations

__all__ = ["ZERO_BUBBLE", "bubble", "in_flight"]

ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


def bubble(schedule: str, S: int, M: int, V: int = 1) -> float:
    """The estimated idle share of a step of `schedule` on S pipeline ranks, M micro-batches, V stages
    each (see the module docstring)."""
    idle = (S - 1) / 3 if schedule in ZERO_BUBBLE else S - 1
    work = V * M
    return idle / (work + idle)


def in_flight(schedule: str, S: int, M: int, V: int = 1, rank: int = 0) -> int:
    """Micro-batches whose saved activations pipeline rank `rank` holds at once, per local stage at
    most: GPipe all M; 1F1B and its interleaved and zero-bubble kin at most S - rank (rank 0 the
    most; the first rank's warm-up); breadth-first runs every micro-batch of a stage before the next,
    M."""
    if schedule in ("gpipe", "looped_bfs"):
        return M
    return min(M, S - rank)
