"""The files of a checkpoint folder: step_<N> names and `latest`, and the safetensors
format read and written tensor by tensor (checked against the safetensors library)."""

import pytest
import torch

from mindspeed_core.checkpoint import steps
from mindspeed_core.checkpoint.safetensors import (
    SafetensorsWriter,
    read_safetensors_header,
    read_tensor,
)
from mindspeed_core.errors import CheckpointError


def test_step_names_parse_and_resolve(tmp_path):
    assert steps.parse_step(tmp_path / "step_12") == 12 == steps.parse_step("step_12")
    for name in ("step_", "step_1x", "xstep_1", ".tmp_step_3", "latest"):
        assert steps.parse_step(name) is None, name
    assert steps.step_dir(tmp_path, 7) == tmp_path / "step_7"
    assert steps.checkpoint_root(tmp_path / "step_7") == tmp_path == steps.checkpoint_root(tmp_path)
    assert steps.read_latest(tmp_path) is None
    with pytest.raises(CheckpointError, match="no latest pointer"):
        steps.resolve(tmp_path)
    (tmp_path / "latest").write_text("step_7\n")
    with pytest.raises(CheckpointError, match="names 'step_7', which is not a step folder"):
        steps.resolve(tmp_path)
    (tmp_path / "step_7").mkdir()
    assert steps.read_latest(tmp_path) == 7
    assert steps.resolve(tmp_path) == tmp_path / "step_7" == steps.resolve(tmp_path / "step_7")
    (tmp_path / "latest").write_text("../elsewhere/step_7")
    with pytest.raises(CheckpointError, match="not step_<N>"):
        steps.read_latest(tmp_path)


def _tensors():
    gen = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(3, 5, generator=gen),
        "b.bias": torch.randn(7, generator=gen).to(torch.bfloat16),
        "c.index": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "d.mask": torch.tensor([True, False, True]),
    }


def test_safetensors_both_ways_match_the_library(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    tensors = _tensors()
    ours = tmp_path / "ours.safetensors"
    writer = SafetensorsWriter(ours, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    for name in reversed(list(tensors)):  # any order
        writer.write(name, tensors[name])
    writer.close()
    theirs = st.load_file(ours)
    assert theirs.keys() == tensors.keys()
    assert all(torch.equal(theirs[n], t) and theirs[n].dtype == t.dtype for n, t in tensors.items())
    library = tmp_path / "library.safetensors"
    st.save_file(tensors, library)
    header = read_safetensors_header(library)
    assert {n: (i.dtype, i.shape) for n, i in header.items()} == {
        n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()
    }
    assert all(torch.equal(read_tensor(header[n]), t) for n, t in tensors.items())


def test_truncated_or_corrupt_safetensors_are_named(tmp_path):
    file = tmp_path / "model.safetensors"
    writer = SafetensorsWriter(file, [("w", torch.float32, (4, 4))])
    writer.write("w", torch.ones(4, 4))
    writer.close()
    data = file.read_bytes()
    file.write_bytes(data[:-8])
    with pytest.raises(CheckpointError, match=r"model.safetensors is truncated \(.*tensor w ends"):
        read_safetensors_header(file)
    file.write_bytes(data[:4])
    with pytest.raises(CheckpointError, match="is truncated"):
        read_safetensors_header(file)
    file.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(CheckpointError, match="corrupt header"):
        read_safetensors_header(file)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_safetensors_header(tmp_path / "missing.safetensors")
