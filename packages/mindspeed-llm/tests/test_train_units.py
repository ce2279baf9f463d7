"""Trainer pieces that need no model: the loader, the config, the loss plot."""

import numpy as np
import pytest

from mindspeed_core.config import load_config
from mindspeed_core.errors import ConfigError
from mindspeed_core.training import MetricsWriter
from mindspeed_llm.train.config import PretrainConfig
from mindspeed_llm.train.loader import PretrainLoader
from mindspeed_llm.train.plots import plot_loss_curve


class _Numbers:
    """Sample i is [i, i, ...]: easy to tell which samples a rank saw."""

    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return {"tokens": np.full(5, i)}


def _global_batches(dp_size, micro_batch, steps, global_batch, start=0):
    loaders = [
        PretrainLoader(_Numbers(), micro_batch=micro_batch, dp_rank=r, dp_size=dp_size)
        for r in range(dp_size)
    ]
    for loader in loaders:
        loader.load_state_dict({"consumed_samples": start})
    accum = global_batch // (micro_batch * dp_size)
    batches = []
    for _ in range(steps):
        seen = set()
        for _ in range(accum):
            for loader in loaders:
                seen.update(loader.next_micro_batch()[:, 0].tolist())
        batches.append(seen)
    return batches, loaders[0].state_dict()


def test_every_layout_sees_the_same_global_batches_and_resumes_exactly():
    one, state = _global_batches(dp_size=1, micro_batch=2, steps=3, global_batch=8)
    four, _ = _global_batches(dp_size=4, micro_batch=1, steps=3, global_batch=8)
    assert one == four == [set(range(0, 8)), set(range(8, 16)), set(range(16, 24))]
    assert state == {"consumed_samples": 24}
    # Resume with another data-parallel size from the consumed-sample count.
    resumed, _ = _global_batches(dp_size=2, micro_batch=2, steps=1, global_batch=8, start=24)
    assert resumed == [set(range(24, 32))]


def test_config_sections_and_mistakes(tmp_path):
    cfg = load_config(PretrainConfig, None, ["--parallel.tp", "2", "--train.precision", "bf16"])
    assert cfg.parallel.tp == 2 and cfg.train.precision == "bf16"
    assert cfg.checkpoint.load == "auto"
    cfg = load_config(PretrainConfig, None, ["--checkpoint.load", str(tmp_path)])
    assert str(cfg.checkpoint.load) == str(tmp_path)
    cfg = load_config(
        PretrainConfig, None, ["--parallel.pp", "2", "--parallel.layers_per_stage", "[3,1]"]
    )
    assert cfg.parallel.pp == 2 and cfg.parallel.layers_per_stage == [3, 1]
    assert cfg.parallel.pp_schedule == "1F1B" and cfg.parallel.pp_microbatches is None
    with pytest.raises(ConfigError, match="parallel.virtual_stages=0 must be >= 1"):
        load_config(PretrainConfig, None, ["--parallel.virtual_stages", "0"])
    with pytest.raises(ConfigError, match="pp_schedule"):
        load_config(PretrainConfig, None, ["--parallel.pp_schedule", "Zigzag"])
    with pytest.raises(ConfigError, match="warmup_steps=50 exceeds train.steps=10"):
        load_config(PretrainConfig, None, ["--train.steps", "10", "--optim.warmup_steps", "50"])
    with pytest.raises(ConfigError, match="train.exit_at_step=0 must be positive"):
        load_config(PretrainConfig, None, ["--train.exit_at_step", "0"])
    with pytest.raises(ConfigError, match="train.stepz"):
        load_config(PretrainConfig, None, ["--train.stepz", "10"])


def test_loss_curve_png(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(1, 11):
        record = {"loss": 5.0 / step}
        if step % 5 == 0:
            record["valid_loss"] = 5.5 / step
        writer.log(step, record)
    writer.close()
    out = plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert plot_loss_curve(tmp_path / "missing.jsonl", tmp_path / "none.png") is None


def test_every_engine_module_stays_small():
    """The engine is split so that no piece grows back into one trainer file."""
    from pathlib import Path

    import mindspeed_llm.train

    folder = Path(mindspeed_llm.train.__file__).parent
    sizes = {p.name: len(p.read_text().splitlines()) for p in folder.glob("*.py")}
    assert {"build.py", "step.py", "loop.py", "objectives.py", "trainer.py"} <= set(sizes)
    assert max(sizes.values()) <= 400, sizes
