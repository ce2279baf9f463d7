"""Test helpers that embedders can use too.

- `run_distributed(fn, world_size, *args)`: run `fn` on several CPU ranks (gloo).
- `requires_device(type)`: a pytest skip marker for cuda/npu-only tests.
"""

from mindspeed_core.testing.spawn import RankFailure, RankTimeout, run_distributed

__all__ = ["RankFailure", "RankTimeout", "requires_device", "run_distributed"]


def requires_device(device_type: str):
    """`@requires_device("cuda")`: skip the test cleanly when the device is absent."""
    import pytest

    from mindspeed_core import device

    return pytest.mark.skipif(
        not device.is_available(device_type), reason=f"needs a {device_type} device"
    )
