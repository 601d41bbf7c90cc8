r"""The exception types of flax_loop.

Every error says what was wrong, quoting the offending value, and what to do.
Each type also derives from the built-in exception a Python user would expect
(`ValueError`, `TypeError`, `OSError`), so existing handlers keep working.
"""


class FlaxLoopError(Exception):
    r"""The base class of every error raised by flax_loop."""


class ConfigError(FlaxLoopError, ValueError):
    r"""An argument of a loop, task, reader or writer is invalid."""


class BatchError(FlaxLoopError, ValueError):
    r"""A batch from the data stream has the wrong form, shape or dtype."""


class DataExhaustedError(FlaxLoopError, ValueError):
    r"""The data stream ended before any step of the requested interval ran."""


class InitError(FlaxLoopError, RuntimeError):
    r"""The model's `init` function failed or returned something unusable."""


class ApplyError(FlaxLoopError, TypeError):
    r"""The model's `apply` does not follow the contract `TrainTask` documents."""


class LossError(FlaxLoopError, TypeError):
    r"""The loss function returned something other than a floating scalar."""


class NonFiniteError(FlaxLoopError, FloatingPointError):
    r"""A loss or gradient became NaN or infinite during training."""


class CheckpointError(FlaxLoopError, OSError):
    r"""A checkpoint file or directory cannot be read or written."""


class CheckpointCorruptError(CheckpointError):
    r"""A checkpoint file is truncated or damaged; it was not loaded."""


class CheckpointVersionError(CheckpointError):
    r"""A checkpoint file was written by a newer format than this reader knows."""


class CheckpointMismatchError(CheckpointError, ValueError):
    r"""A checkpoint file holds another model (different tree or shapes)."""


class StateLostError(FlaxLoopError, RuntimeError):
    r"""A loop whose state an interrupt destroyed mid-step; make a new one that resumes."""


class StoppedError(FlaxLoopError, RuntimeError):
    r"""Training was asked for after a stop by signal ended the process's training."""


class MetricError(FlaxLoopError, KeyError):
    r"""A metric named by a reader or writer is missing from a summary."""

    def __str__(self) -> str:
        # KeyError quotes its message; show it as written.
        return str(self.args[0]) if self.args else ""


def check_count(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    r"""`value` as an int if it is an integer in `[minimum, maximum]`.

    The one check of every count argument (steps, sizes, `keep`, ...).

    >>> check_count("keep", 2, 1)
    2
    >>> check_count("keep", 0, 1)
    Traceback (most recent call last):
    ...
    flax_loop.errors.ConfigError: keep must be >= 1; got 0.

    Raises:
        ConfigError: naming the argument, the value and the range.
    """
    import numpy as np

    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(
            f"{name} must be an integer >= {minimum}; got {value!r} of type {type(value).__name__}."
        )
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}; got {value}.")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name} must be <= {maximum:,}; got {value:,}.")
    return int(value)


_JAX_FRAMES_NOTE = "JAX has removed its internal frames"


def last_word(error: BaseException) -> BaseException:
    r"""`error` made to end what a user sees: JAX's note on the frames it
    removed dropped (our message is then the last line printed) and the
    traceback through the tracing internals cut (raise it `from None` at
    flax_loop's boundary: the traceback starts there).

    >>> error = ConfigError("task.apply must be ...")
    >>> error.add_note("-----\nFor simplicity, JAX has removed its internal frames ...")
    >>> last_word(error).__notes__
    []
    """
    notes = getattr(error, "__notes__", None)
    if notes is not None:
        error.__notes__ = [note for note in notes if _JAX_FRAMES_NOTE not in note]
    return error.with_traceback(None)
