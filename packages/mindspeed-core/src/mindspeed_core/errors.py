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
