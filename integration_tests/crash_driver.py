"""A toy training run over CheckpointManager and MetricsWriter, for crash-point tests.

`train(folder, steps)` resumes from `folder`'s checkpoints (if any), trains a small
model with dropout (so the RNG state matters) to `steps`, saves every `INTERVAL` steps
keeping `KEEP_LAST`, and logs each step's loss to `folder/metrics.jsonl`. Losses of a
run that crashed and was run again must equal those of a run that never stopped.

Run as a script (`python crash_driver.py FOLDER STEPS [--async]`) it is the process a
test kills: with MINDSPEED_TEST_CRASH_AT the manager SIGKILLs itself at a save point;
with CRASH_DRIVER_DCP=write@N|metadata@N this script SIGKILLs the process inside DCP's
own writing of step N (half a shard file, or `.metadata.tmp` written but not renamed).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mindspeed_core.checkpoint import CheckpointManager, ModelState, RNGState, TrainState
from mindspeed_core.optim import build_lr_schedulers, build_optimizers
from mindspeed_core.training import MetricsWriter

INTERVAL = 2
KEEP_LAST = 2
VOCAB, DIM = 32, 16


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        h = F.dropout(torch.tanh(self.hidden(self.embed(tokens))), p=0.2, training=True)
        return self.out(h)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (4, 9), generator=gen)
    return data[:, :-1], data[:, 1:]


def build(folder: Path, steps: int, async_save: bool = False):
    torch.manual_seed(0)
    model = Toy()
    optimizer = build_optimizers(model, lr=1e-2, weight_decay=0.1)
    scheduler = build_lr_schedulers(optimizer, warmup_steps=1, total_steps=steps)
    state = TrainState()
    states = {
        "model": ModelState(model),
        "optimizer": optimizer,
        "scheduler": scheduler,
        "train": state,
        "rng": RNGState(),
    }
    manager = CheckpointManager(
        states,
        folder / "checkpoints",
        interval=INTERVAL,
        keep_last=KEEP_LAST,
        async_save=async_save,
    )
    return model, optimizer, scheduler, state, manager


def train(folder: Path, steps: int, async_save: bool = False) -> int | None:
    """Train to `steps`; returns the step it resumed from (None: a fresh start)."""
    model, optimizer, scheduler, state, manager = build(folder, steps, async_save)
    resumed = manager.load()
    metrics = MetricsWriter(folder, tensorboard=False, resume_step=resumed or 0)
    try:
        while state.step < steps:
            tokens, labels = batch(state.step)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
            loss.backward()
            optimizer.step()
            scheduler.step()
            state.step += 1
            metrics.log(state.step, {"loss": loss.item()})
            manager.save(state.step)
        manager.save(state.step, force=True)  # the end of the run, as the trainer does
        manager.close()
    finally:
        metrics.close()
    return resumed


def _die_inside_dcp(spec: str) -> None:
    """SIGKILL this process in the middle of DCP's own writing of one step (test-only)."""
    import torch.distributed.checkpoint.filesystem as fs

    where, step = spec.split("@")
    folder = f".tmp_step_{step}"
    if where == "write":
        real = fs._write_item

        def half_then_die(transforms, stream, data, write_item, *args, **kwargs):
            result = real(transforms, stream, data, write_item, *args, **kwargs)
            if folder in str(getattr(stream, "name", "")) and stream.tell() > 4096:
                stream.flush()  # a shard file partly written, then the power goes
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        fs._write_item = half_then_die
    elif where == "metadata":
        real_rename = fs.FileSystem.rename

        def die_before_rename(self, path, new_path):
            if folder in str(path) and str(path).endswith(".metadata.tmp"):
                os.kill(os.getpid(), signal.SIGKILL)
            return real_rename(self, path, new_path)

        fs.FileSystem.rename = die_before_rename


if __name__ == "__main__":
    if os.environ.get("CRASH_DRIVER_DCP"):
        _die_inside_dcp(os.environ["CRASH_DRIVER_DCP"])
    train(Path(sys.argv[1]), int(sys.argv[2]), async_save="--async" in sys.argv)
