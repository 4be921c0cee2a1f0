"""Every error and warning the compiler raises, under two bases: `AutoparError` and `AutoparWarning`.

`autopar.errors` re-exports these and adds the product's own (checkpoints, compile, fallbacks), so
`except autopar.AutoparError` catches whatever autopar raised. Each class also derives from the
builtin that code written before the hierarchy caught (`ValueError`, `RuntimeError`, `MemoryError`,
...), so those `except` clauses keep working.

>>> issubclass(ShardingError, AutoparError) and issubclass(ShardingError, ValueError)
True
"""


class AutoparError(Exception):
    """The base of every error autopar raises."""


class AutoparWarning(UserWarning):
    """The base of every warning autopar gives."""


class UsageError(AutoparError, ValueError):
    """A value given to autopar (an option, an argument, an input, a file's content) is not one it
    accepts; the message names it, the value expected and what to do."""


class CaptureError(AutoparError, RuntimeError):
    """torch.export could not trace the model."""


class IndexRangeError(AutoparError, IndexError):
    """An id reaching an embedding table, or a target reaching a cross-entropy, lies outside the
    table's rows (one process raises IndexError there); the message names the value and the range."""


class ShardingError(AutoparError, ValueError):
    """A tensor cannot be laid out as asked (for example a dimension not divisible by q)."""


class CollectiveError(AutoparError, RuntimeError):
    """A collective failed or timed out: a peer rank exited, crashed or is stuck."""


class MemoryLimitError(AutoparError, MemoryError):
    """No plan fits `memory_limit`: no strategy on the grid, no grid shape of the devices, or no plan
    of a generation phase beside the parameter blocks stored."""


class UnsupportedError(AutoparError, NotImplementedError):
    """A call autopar does not serve: beam search, generating with an encoder-decoder model, a
    parameter created or resized after parallelize; the message says what to do instead."""


class TorchVersionError(AutoparError, RuntimeError):
    """The installed torch lacks a private API autopar relies on (`passes.compat` lists each with the
    version it was checked on)."""


class SignatureError(AutoparError, TypeError):
    """A call whose arguments are not the ones the program takes: positions or keywords other than
    parallelize's example inputs, keywords pmodel.generate does not know."""


class DuplicateRuleError(AutoparError, RuntimeError):
    """A second sharding rule registered for an op that has one."""


class SearchWarning(AutoparWarning):
    """strategy='auto': the search is running long (said once), or it stopped at its time budget."""


class RoutingWarning(AutoparWarning):
    """An MoE layer keeps the gathered token dispatch."""


class FallbackWarning(AutoparWarning):
    """Some ops run unsplit (gathered whole on every rank): correct, but slower and bigger."""


class MovedWarning(AutoparWarning, DeprecationWarning):
    """A module imported by the path of an earlier release (`autopar.moved`). A DeprecationWarning
    too, so Python's default filters show it only in `__main__`, as before."""
