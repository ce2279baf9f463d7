"""A tiny program built the way MindSpeed commands are: a config tree, YAML + overrides,
and the CLI's error wrapper. Tests run it in a subprocess to check what users see."""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field

from mindspeed_core.cli import debug_enabled, guarded
from mindspeed_core.config import config_from_args, dump_yaml


class Precision(enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1


@dataclass(kw_only=True)
class ParallelConfig:
    tp: int = 1
    dp_shard: int = -1

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"tp must be at least 1, got {self.tp}")


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 10
    precision: Precision = Precision.FP32
    compile: bool = False
    data_paths: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class AppConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def main(argv: list[str]) -> int:
    cfg = config_from_args(AppConfig, [a for a in argv if a != "--debug"])
    print(dump_yaml(cfg), end="")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main, sys.argv[1:], debug=debug_enabled(sys.argv)))
