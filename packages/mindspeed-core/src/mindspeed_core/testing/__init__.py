"""Test helpers that embedders can use too.

- `run_distributed(fn, world_size, *args)`: run `fn` on several CPU ranks (gloo).
- `requires_device(type)`: a pytest skip marker for cuda/npu-only tests.
- `import_sibling(__file__, "helpers")`: import a helper module next to a test file.
- `processes.descendants(pid)` / `gone_within(pids, s)`: what a killed parent left running.
- `faults.disk_full_after(saves)`: checkpoint saves that fail as on a full disk.
- `HostSyncs(host=tensors)`: counts the host reads of device values (syncs) of a piece of
  code, on CPU too.
"""

import importlib.util
import sys
from pathlib import Path

from mindspeed_core.testing.spawn import RankFailure, RankTimeout, run_distributed
from mindspeed_core.testing.syncs import HostSyncs

__all__ = [
    "HostSyncs",
    "RankFailure",
    "RankTimeout",
    "import_sibling",
    "requires_device",
    "run_distributed",
]


def requires_device(device_type: str):
    """`@requires_device("cuda")`: skip the test cleanly when the device is absent."""
    import pytest

    from mindspeed_core import device

    return pytest.mark.skipif(
        not device.is_available(device_type), reason=f"needs a {device_type} device"
    )


def import_sibling(test_file: str, name: str):
    """Import `<dir of test_file>/<name>.py` once, under a name unique to its path.

    Test files run in pytest's importlib mode cannot import each other; this gives
    them a shared helper module (also inside `run_distributed` ranks, which load the
    test file and so run this line again).
    """
    path = Path(test_file).resolve().parent / f"{name}.py"
    key = "_mindspeed_test_helper_" + "_".join(path.with_suffix("").parts[-3:]).replace("-", "_")
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
