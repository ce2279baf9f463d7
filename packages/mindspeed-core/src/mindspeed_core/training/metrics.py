"""Per-step metrics: one JSON object per line in `metrics.jsonl`, mirrored to TensorBoard.

Only rank 0 writes (other ranks get a writer that does nothing), so callers need
no rank checks. TensorBoard is optional: without the `tensorboard` package the
JSONL file is still written and one warning says why `tb/` is empty.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from mindspeed_core.distributed import is_rank0

logger = logging.getLogger("mindspeed.metrics")
METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"


class MetricsWriter:
    """Append metrics of a run to `<run_dir>/metrics.jsonl` and `<run_dir>/tb/`.

    Args:
        run_dir: the run directory (created if needed).
        tensorboard: also write TensorBoard event files.
        resume_step: when resuming, drop lines logged after this step, so a run that
            crashed after its last checkpoint does not leave duplicate steps.
    """

    def __init__(
        self, run_dir: str | Path, *, tensorboard: bool = True, resume_step: int | None = None
    ):
        self.enabled = is_rank0()
        self.path = Path(run_dir) / METRICS_FILE
        self._tb = None
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            _truncate_after(self.path, resume_step)
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        if tensorboard:
            self._tb = _tensorboard(Path(run_dir) / TB_DIR)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _json_value(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _json_value(value: Any) -> Any:
    """A Python number for a 0-d tensor (or numpy scalar), so the record is JSON-able."""
    if hasattr(value, "item"):
        return value.item()
    return value


def _truncate_after(path: Path, step: int) -> None:
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def _tensorboard(folder: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        logger.warning("tensorboard is not installed; writing %s only", METRICS_FILE)
        return None
    return SummaryWriter(log_dir=str(folder))
