"""MindSpeed core: the parallel runtime.

Importing this package is cheap (no torch import); the submodules
(`device`, `distributed`, `config`, `testing`, ...) are imported on use.
"""

from importlib.metadata import PackageNotFoundError, version

from mindspeed_core.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    DeviceError,
    MindSpeedError,
    ParallelError,
)

try:
    __version__ = version("mindspeed-core")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DeviceError",
    "MindSpeedError",
    "ParallelError",
    "__version__",
]
