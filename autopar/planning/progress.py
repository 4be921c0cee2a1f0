"""Progress of long work on rank 0's stderr: a tqdm bar that appears only when the work has run
longer than a couple of seconds (`AUTOPAR_PROGRESS_DELAY`, seconds, default 2), and nothing on other
ranks or when tqdm is missing. Used by `max_batch` (one step per scheme and setting), `plan` (capture,
passes, memory) and `autopar bench` (one step per stage); loading shards and the first compile say
their own (`autopar.checkpoint.hf`, `autopar.parallel.run`)."""

from __future__ import annotations

import os
import sys

__all__ = ["steps"]


class _Quiet:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def _rank() -> int:
    try:
        import torch.distributed as dist
    except ImportError:
        return 0
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))


def steps(desc: str, total: int, enabled: bool = True):
    """A bar of `total` steps described by `desc` (`update()` per step, `set_postfix_str` for what runs
    now); a silent stand-in on ranks other than 0, when `enabled` is False, or without tqdm."""
    if not enabled or _rank() != 0:
        return _Quiet()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Quiet()
    delay = float(os.environ.get("AUTOPAR_PROGRESS_DELAY", "2"))
    return tqdm(total=total, desc=desc, unit="step", delay=delay, file=sys.stderr, leave=False)
