"""The config sections core gives every command: `parallel`, `optim`, `checkpoint`, with the
YAML keys of `mindspeed pretrain`, building what they configure."""

from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from mindspeed_core.checkpoint import CheckpointConfig, CheckpointManager
from mindspeed_core.config import load_config
from mindspeed_core.errors import ConfigError
from mindspeed_core.optim import OptimConfig
from mindspeed_core.parallel import ParallelConfig, ParallelDims


@dataclass(kw_only=True)
class Job:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def test_sections_load_strictly_from_yaml_and_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("parallel:\n  tp: 2\n  cp: 2\n  cp_mode: ulysses\noptim:\n  lr: 0.01\n")
    cfg = load_config(Job, path, ["--checkpoint.interval", "5", "--parallel.dp_shard", "2"])
    assert (cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.cp_mode) == (2, 2, "ulysses")
    assert cfg.optim.lr == 0.01 and cfg.checkpoint.interval == 5
    dims = cfg.parallel.dims(world_size=8)
    assert isinstance(dims, ParallelDims) and (dims.dp_shard, dims.tp, dims.cp) == (2, 2, 2)
    with pytest.raises(ConfigError, match="parallel.ulysses_degree dividing parallel.cp=4, got 3"):
        load_config(Job, None, ["--parallel.cp", "4", "--parallel.cp_mode", "hybrid",
                                "--parallel.ulysses_degree", "3"])  # fmt: skip
    with pytest.raises(ConfigError, match="parallel.tpp"):
        load_config(Job, None, ["--parallel.tpp", "2"])


def test_optim_and_checkpoint_sections_build_their_components(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    optimizer, scheduler = OptimConfig(lr=0.5, warmup_steps=2, weight_decay=0.1).build(model, 10)
    groups = optimizer.optimizers[0].param_groups
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.1]
    assert scheduler.get_last_lr() == pytest.approx(0.25)  # warmup step 1 of 2
    manager = CheckpointConfig(interval=3, keep_last=1).manager({"optimizer": optimizer}, tmp_path)
    assert isinstance(manager, CheckpointManager) and manager.folder == tmp_path / "checkpoints"
    assert manager.should_save(6) and not manager.should_save(4)
    assert CheckpointConfig(dir=tmp_path / "elsewhere").folder(tmp_path) == tmp_path / "elsewhere"
    torch.testing.assert_close(groups[0]["lr"], 0.25)
