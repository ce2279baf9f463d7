"""What the checksums cost: CheckpointManager.save against a bare dcp.save of one state.

    python benchmarks/checkpoint_checksums.py [--mib 512] [--repeats 3]

Both write the same state (fp32 tensors of 2048 x 2048, `--mib` in all) in this process;
the manager also hashes every record into checksums.json, renames the folder and writes
`latest`. A full verification (`verify_checksums`, what a fallback to an older step costs)
and a resume's load (which checks each record as it reads it) are timed too, the latter
against a bare dcp.load. Fastest of `--repeats`. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from mindspeed_core.checkpoint import CheckpointManager, verify_checksums


class _Plain:
    """A Stateful over a dict of tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def state_dict(self):
        return self.tensors

    def load_state_dict(self, state_dict):
        self.tensors.update(state_dict)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _one_round(tensors: dict[str, torch.Tensor], bare: Path, ours: Path) -> dict[str, float]:
    manager = CheckpointManager({"model": _Plain(tensors)}, ours)
    times = {
        "dcp_save": _timed(
            lambda: dcp.save({"model": tensors}, checkpoint_id=str(bare), no_dist=True)
        ),
        "manager_save": _timed(lambda: manager.save(1, force=True)),
        "verify": _timed(lambda: verify_checksums(ours / "step_1")),
        "dcp_load": _timed(
            lambda: dcp.load({"model": tensors}, checkpoint_id=str(bare), no_dist=True)
        ),
    }
    fresh = CheckpointManager({"model": _Plain(tensors)}, ours)
    times["manager_load"] = _timed(fresh.load)
    shutil.rmtree(bare)
    shutil.rmtree(ours)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    tensors = {f"w{i}": torch.randn(2048, 2048) for i in range(args.mib // 16)}
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    best: dict[str, float] = {}
    try:
        for rep in range(args.repeats):
            for name, seconds in _one_round(
                tensors, root / f"bare{rep}", root / f"ours{rep}"
            ).items():
                best[name] = min(best.get(name, float("inf")), seconds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        json.dumps(
            {
                "state_mib": args.mib,
                **{f"{k}_s": round(v, 3) for k, v in best.items()},
                "save_ratio": round(best["manager_save"] / best["dcp_save"], 2),
                "load_ratio": round(best["manager_load"] / best["dcp_load"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
