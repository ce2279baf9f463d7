"""Per-step metrics: one JSON object per line in `metrics.jsonl`, mirrored to TensorBoard
and, when asked, to Weights & Biases.

Only rank 0 writes (other ranks get a writer that does nothing), so callers need
no rank checks. TensorBoard is optional: without the `tensorboard` package the
JSONL file is still written and one warning says why `tb/` is empty. W&B (`WandbOptions`,
extra `mindspeed-core[wandb]`) gets the same scalars at the same steps; its run id is kept in
`<run_dir>/wandb-run-id`, so a resumed run continues the same W&B run.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindspeed_core.distributed import is_rank0
from mindspeed_core.errors import ConfigError, DataError
from mindspeed_core.files import check_folder, write_file_atomically

logger = logging.getLogger("mindspeed.metrics")
METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
WANDB_ID_FILE = "wandb-run-id"


@dataclass(frozen=True)
class WandbOptions:
    """A W&B run for the metrics: `project`, `name` (None: the run directory's name) and
    `mode` ("offline": files under `<run_dir>/wandb/` only, `wandb sync` uploads them later;
    "online": streamed to the W&B server)."""

    project: str = "mindspeed"
    name: str | None = None
    mode: str = "offline"


def check_wandb(options: WandbOptions | None) -> None:
    """Refuse, in one line, W&B logging without the package (before a run writes anything)."""
    if options is None:
        return
    if options.mode not in ("offline", "online"):
        raise ConfigError(f"logging.wandb_mode={options.mode!r}: choose offline or online")
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError(
            "logging.wandb=true needs the wandb package: pip install 'mindspeed-core[wandb]'"
        ) from None


class MetricsWriter:
    """Append metrics of a run to `<run_dir>/metrics.jsonl` and `<run_dir>/tb/`.

    Args:
        run_dir: the run directory (created if needed).
        tensorboard: also write TensorBoard event files.
        resume_step: when resuming, drop lines logged after this step, so a run that
            crashed after its last checkpoint does not leave duplicate steps (and a
            line torn by a crash mid-write).

    Raises:
        ConfigError: `run_dir` is a file. DataError: a metrics line before the last is
            not JSON.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        resume_step: int | None = None,
        wandb: WandbOptions | None = None,
    ):
        self.enabled = is_rank0()
        self.path = check_folder(run_dir, "run directory") / METRICS_FILE
        self._tb = self._wandb = None
        if not self.enabled:
            return
        check_wandb(wandb)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            _truncate_after(self.path, resume_step)
        else:
            _drop_torn_tail(self.path)
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        if tensorboard:
            self._tb = _tensorboard(Path(run_dir) / TB_DIR)
        if wandb is not None:
            self._wandb = _wandb_run(Path(run_dir), wandb, resumed=bool(resume_step))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _json_value(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in record.items()
                   if k != "step" and isinstance(v, int | float) and math.isfinite(v)}  # fmt: skip
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in order.

    A torn last line (the process died while writing it) is left out.

    Raises:
        DataError: a line before the last is not a JSON object (named by file:line).
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            if number == len(lines):  # no newline after it: a write cut short
                logger.warning("%s:%d is a torn line (a crash mid-write); dropped", path, number)
                break
            raise DataError(f"{path}:{number} is not a JSON object: {line[:80]!r}")
        records.append(record)
    return records


def _json_value(value: Any) -> Any:
    """A Python number for a 0-d tensor (or numpy scalar), so the record is JSON-able."""
    if hasattr(value, "item"):
        return value.item()
    return value


def _truncate_after(path: Path, step: int) -> None:
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    write_file_atomically(path, "".join(json.dumps(r) + "\n" for r in kept))


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line without its newline (a crash mid-write), so appends start clean."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        f.truncate(data.rfind(b"\n") + 1)
    logger.warning("%s ended in a torn line (a crash mid-write); dropped it", path)


def _wandb_run(run_dir: Path, options: WandbOptions, *, resumed: bool):
    """The W&B run of `run_dir`: the same one again when the run resumes (its id is kept in
    the run directory), a new one otherwise."""
    import wandb

    id_file = run_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if resumed and id_file.is_file() else uuid.uuid4().hex[:16]
    write_file_atomically(id_file, run_id + "\n")
    return wandb.init(project=options.project, name=options.name or run_dir.resolve().name,
                      mode=options.mode, dir=str(run_dir), id=run_id, resume="allow",
                      settings=wandb.Settings(silent=True, console="off"))  # fmt: skip


def _tensorboard(folder: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        logger.warning("tensorboard is not installed; writing %s only", METRICS_FILE)
        return None
    return SummaryWriter(log_dir=str(folder))
