"""Errors for user mistakes.

A `MindSpeedError` means the user can fix it (a config field, a path, a layout);
its message names the offending file, field or value. The CLI prints it on one
line and exits with status 2. Internal invariants use `assert` instead.
"""


class MindSpeedError(Exception):
    """Base class of every error caused by user input."""


class ConfigError(MindSpeedError):
    """A configuration file or override is wrong (unknown key, bad type, bad value)."""


class DataError(MindSpeedError):
    """Input data is missing or malformed."""


class CheckpointError(MindSpeedError):
    """A checkpoint is missing, incomplete or does not fit the model."""


class ParallelError(MindSpeedError):
    """A parallel layout or the distributed environment is inconsistent."""


class DeviceError(MindSpeedError):
    """A requested device is unknown or not available."""


class DiskFullError(MindSpeedError):
    """The disk (or quota) filled while writing an output; the partial output was removed."""


def is_disk_full(error: BaseException | None) -> bool:
    """Whether `error`, or an error it wraps (its cause, context, or the failures of DCP's
    CheckpointException), is "no space left on device" or "disk quota exceeded"."""
    import errno

    seen: set[int] = set()
    pending = [error]
    while pending:
        err = pending.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        pending += [err.__cause__, err.__context__]
        failures = getattr(err, "failures", None)
        if isinstance(failures, dict):
            pending += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return False


def disk_full_error(path, needed_bytes: int | None = None) -> DiskFullError:
    """The one-line error for a write to `path` that ran out of space."""
    import os
    import shutil

    where = os.path.abspath(path)
    probe = where
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        free = f", {shutil.disk_usage(probe).free / 1e6:.0f} MB free"
    except OSError:
        free = ""
    needed = f"needed ~{max(needed_bytes, 0) / 1e6:.0f} MB{free}" if needed_bytes else free[2:]
    detail = f" ({needed})" if needed else ""
    return DiskFullError(
        f"no space left on device for {where}{detail}; the partial output was removed"
    )
