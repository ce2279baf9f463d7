"""MetricsWriter: metrics.jsonl lines, TensorBoard events, clean resume."""

import json

import pytest
import torch

from mindspeed_core.errors import ConfigError, DataError
from mindspeed_core.training import MetricsWriter, read_metrics


def test_jsonl_and_tensorboard(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.log(1, {"loss": torch.tensor(2.5), "lr": 1e-3})
    writer.log(2, {"loss": 2.0, "lr": 1e-3, "note": "text is kept in jsonl"})
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"step": 1, "loss": 2.5, "lr": 1e-3},
        {"step": 2, "loss": 2.0, "lr": 1e-3, "note": "text is kept in jsonl"},
    ]
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0


def test_resume_drops_steps_after_the_checkpoint(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(1, 6):
        writer.log(step, {"loss": float(step)})
    writer.close()
    writer = MetricsWriter(tmp_path, tensorboard=False, resume_step=3)  # crashed after step 5
    writer.log(4, {"loss": 40.0})
    writer.close()
    steps = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert steps == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    assert not (tmp_path / "tb").exists()


def test_a_torn_last_line_is_dropped_on_resume_and_on_append(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    writer = MetricsWriter(tmp_path, tensorboard=False, resume_step=2)
    writer.log(3, {"loss": 30.0})
    writer.close()
    path.write_text(path.read_text() + '{"step": 4, "lo')  # torn again, then a fresh start
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.log(5, {"loss": 5.0})
    writer.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [
        (1, 1.0),
        (2, 2.0),
        (3, 30.0),
        (5, 5.0),
    ]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(DataError, match=r"metrics.jsonl:2 is not a JSON object"):
        MetricsWriter(tmp_path, tensorboard=False, resume_step=3)


def test_a_run_directory_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "run").write_text("")
    with pytest.raises(
        ConfigError, match=r"run directory .*sub lies under the file .*run, not a folder"
    ):
        MetricsWriter(tmp_path / "run" / "sub", tensorboard=False)
