"""CheckpointManager against hostile, corrupt and full-disk checkpoints (one process)."""

import contextlib
import errno
import os
import warnings

import pytest
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs
from torch.distributed.checkpoint import FileSystemReader

from mindspeed_core.checkpoint import CHECKSUMS_FILE, LATEST, read_safe_metadata
from mindspeed_core.errors import CheckpointError, DiskFullError
from mindspeed_core.testing import import_sibling
from mindspeed_core.testing.hostile import plant_hostile_item, plant_hostile_metadata

ckpt = import_sibling(__file__, "test_checkpoint")


def _manager(folder, **kwargs):
    return ckpt._setup({}, folder, **kwargs)[-1]


def _saved(folder, steps=(5,), **kwargs):
    manager = _manager(folder, **kwargs)
    for step in steps:
        manager.save(step, force=True)
    return manager


def test_hostile_metadata_and_items_run_nothing(tmp_path):
    marker = tmp_path / "pwned"
    _saved(tmp_path / "a")
    plant_hostile_metadata(tmp_path / "a" / "step_5", marker)
    with pytest.raises(CheckpointError, match=r"refused to load global posix\.system"):
        _manager(tmp_path / "a").load()
    _saved(tmp_path / "b")
    plant_hostile_item(tmp_path / "b" / "step_5", "train.step", marker)
    with pytest.raises(CheckpointError, match=r"train\.step is not plain data"):
        _manager(tmp_path / "b").load()
    assert not marker.exists()
    # The plants are real: DCP's own reader runs them.
    with contextlib.suppress(AttributeError):  # os.system's exit status is no Metadata
        FileSystemReader(str(tmp_path / "a" / "step_5")).read_metadata()
    assert marker.exists()
    marker.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"train": {"step": 0}}, checkpoint_id=str(tmp_path / "b" / "step_5"), no_dist=True)
    assert marker.exists()


def _flip_a_tensor_byte(step_dir):
    shard = next(step_dir.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the middle of the file: inside a tensor record
    shard.write_bytes(bytes(data))
    return shard


def test_a_flipped_byte_in_any_record_is_refused_naming_the_shard(tmp_path):
    _saved(tmp_path)
    step_dir = tmp_path / "step_5"
    records = sorted(read_safe_metadata(step_dir).storage_data.values(), key=lambda i: i.offset)
    assert len(records) > 100  # model, optimizer moments and groups, scheduler, counters, RNG
    manager = _manager(tmp_path)
    for info in [*records[::10], records[-1]]:  # every tenth record (each load ~50 ms)
        shard = step_dir / info.relative_path
        data = shard.read_bytes()
        flipped = bytearray(data)
        flipped[info.offset + info.length // 2] ^= 0x01
        shard.write_bytes(bytes(flipped))
        with pytest.raises(
            CheckpointError, match=f"shard {shard} is corrupt: the record at byte {info.offset} "
        ):
            manager.load()
        shard.write_bytes(data)
    assert manager.load() == 5


def test_missing_or_garbled_latest_resumes_from_the_newest_verified_step(tmp_path):
    _saved(tmp_path, steps=(2, 4, 6))
    _flip_a_tensor_byte(tmp_path / "step_6")
    (tmp_path / LATEST).unlink()
    manager = _manager(tmp_path)
    assert manager.load() == 4  # step_6 fails its checksums: skipped
    (tmp_path / LATEST).write_text("step_6\x00garbage")
    assert _manager(tmp_path).load() == 4
    for step in (2, 4):
        _flip_a_tensor_byte(tmp_path / f"step_{step}")
    with pytest.raises(CheckpointError, match=r"no usable checkpoint .*step_6/__0_0.distcp"):
        _manager(tmp_path).load()


def test_the_step_just_loaded_is_not_written_again(tmp_path):
    _saved(tmp_path, steps=(3,))
    (tmp_path / LATEST).unlink()
    shard = tmp_path / "step_3" / "__0_0.distcp"
    before = os.stat(shard)
    manager = _manager(tmp_path)
    assert manager.load() == 3
    assert manager.save(3, force=True) is False  # a finished run run again
    after = os.stat(shard)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert (tmp_path / LATEST).read_text() == "step_3\n"  # repaired


def test_another_runs_checkpoint_of_a_step_is_replaced_only_when_the_new_one_is_whole(tmp_path):
    _saved(tmp_path, steps=(3,))
    old = (tmp_path / "step_3" / CHECKSUMS_FILE).read_text()
    manager = _manager(tmp_path, seed=9)  # other weights: another run, same folder
    assert manager.save(3, force=True)
    assert (tmp_path / "step_3" / CHECKSUMS_FILE).read_text() != old
    assert sorted(os.listdir(tmp_path)) == [LATEST, "step_3"]


def test_keep_last_keeps_the_newest_and_sweeps_crash_leftovers(tmp_path):
    (tmp_path / ".tmp_step_9").mkdir(parents=True)
    (tmp_path / ".trash_step_1").mkdir()
    _saved(tmp_path, steps=(2, 4, 6), keep_last=1)
    assert sorted(os.listdir(tmp_path)) == [LATEST, "step_6"]


def test_a_full_disk_is_one_line_and_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    manager = _saved(tmp_path, steps=(2,))

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_fs, "_write_item", no_space)
    with pytest.raises(
        DiskFullError, match=r"no space left on device for .*\.tmp_step_4 \(needed ~\d+ MB"
    ):
        manager.save(4, force=True)
    assert sorted(os.listdir(tmp_path)) == [LATEST, "step_2"]
    assert manager.latest_step() == 2
