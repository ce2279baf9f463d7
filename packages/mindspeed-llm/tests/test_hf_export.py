"""`logging.hf_export_every` writes through `mindspeed_llm.hf_export` in the trainer's own
process: no child process is started, a folder that is not a checkpoint is one `TrainingError`
naming both paths with nothing written, and an existing export (a resumed run) is kept.
That an export loads in transformers is `integration_tests/test_hf_export.py`."""

import subprocess

import pytest

from mindspeed_llm.train.loop import export_hf
from mindspeed_llm.train.step import TrainingError


def test_a_bad_checkpoint_is_one_error_in_process_and_writes_nothing(tmp_path, monkeypatch):
    def no_child(*args, **kwargs):
        raise AssertionError("export_hf started a child process")

    monkeypatch.setattr(subprocess, "run", no_child)
    monkeypatch.setattr(subprocess, "Popen", no_child)
    step_dir, out = tmp_path / "checkpoints" / "step_10", tmp_path / "hf" / "step_10"
    step_dir.mkdir(parents=True)
    with pytest.raises(TrainingError) as err:
        export_hf(step_dir, out)
    message = str(err.value)
    assert message.startswith(f"logging.hf_export_every: exporting {step_dir} to {out} failed: ")
    assert len(message.splitlines()) == 1
    assert not out.exists() and not (tmp_path / "hf").exists()


def test_an_existing_export_is_kept(tmp_path):
    out = tmp_path / "hf" / "step_10"
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"kept")
    export_hf(tmp_path / "missing", out)  # not even read: the export exists
    assert (out / "model.safetensors").read_bytes() == b"kept"
