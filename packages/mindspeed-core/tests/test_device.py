import pytest
import torch

from mindspeed_core import device
from mindspeed_core.errors import DeviceError
from mindspeed_core.testing import requires_device


def test_auto_detection_follows_what_is_present(monkeypatch):
    monkeypatch.delenv(device.DEVICE_ENV_VAR, raising=False)
    expected = "npu" if device.npu_available() else "cuda" if device.cuda_available() else "cpu"
    assert device.detect_device_type() == expected
    assert device.detect_device_type("auto") == expected


def test_override_from_env_and_argument(monkeypatch):
    monkeypatch.setenv(device.DEVICE_ENV_VAR, "CPU")
    assert device.detect_device_type() == "cpu"
    monkeypatch.setenv(device.DEVICE_ENV_VAR, "tpu")
    with pytest.raises(
        DeviceError, match=r"MINDSPEED_DEVICE='tpu' is not a device type; choose one of"
    ):
        device.detect_device_type()
    assert device.detect_device_type("cpu") == "cpu"  # an explicit argument wins over the env


@pytest.mark.parametrize("kind", ["cuda", "npu"])
def test_requesting_an_absent_accelerator_is_a_clear_error(kind):
    if device.is_available(kind):
        pytest.skip(f"{kind} is present")
    with pytest.raises(DeviceError, match=rf"device={kind!r} was requested but no {kind} device"):
        device.detect_device_type(kind)
    assert device.device_count(kind) == 0


def test_backends():
    assert [device.backend_for(t) for t in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]
    with pytest.raises(DeviceError, match="'xpu'"):
        device.backend_for("xpu")


def test_cpu_device_and_memory_stats():
    dev = device.get_device(0, "cpu")
    assert dev == torch.device("cpu") and device.device_count("cpu") == 1
    device.synchronize(dev)
    before = device.memory_stats(dev)["peak_gb"]
    block = torch.ones(64, 1024, 1024)  # 256 MiB
    after = device.memory_stats(dev)["peak_gb"]
    assert after >= before + 0.2, (before, after)
    assert set(device.memory_stats(dev)) == {"allocated_gb", "reserved_gb", "peak_gb"}
    assert device.device_name("cpu")
    del block


@requires_device("cuda")
@pytest.mark.gpu
def test_cuda_device_memory_and_sync():
    dev = device.get_device(0, "cuda")
    assert dev.type == "cuda" and torch.cuda.current_device() == 0
    device.reset_peak_memory(dev)
    x = torch.ones(1024, 1024, 64, device=dev)
    device.synchronize(dev)
    assert device.memory_stats(dev)["peak_gb"] >= 0.25
    with pytest.raises(DeviceError, match="LOCAL_RANK=99"):
        device.get_device(99, "cuda")
    del x


@requires_device("npu")
@pytest.mark.npu
def test_npu_device_memory_and_sync():
    dev = device.get_device(0, "npu")
    assert dev.type == "npu" and device.backend_for("npu") == "hccl"
    x = torch.ones(1024, 1024, 64, device=dev)
    device.synchronize(dev)
    assert device.memory_stats(dev)["peak_gb"] >= 0.25
    del x
