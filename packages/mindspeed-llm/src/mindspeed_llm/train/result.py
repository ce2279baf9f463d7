"""What a training step reports (`StepResult`), kept on the device until it is read."""

from __future__ import annotations

import logging

import torch

from mindspeed_core.checkpoint import TrainState
from mindspeed_core.errors import MindSpeedError
from mindspeed_core.parallel.dtensor import full

logger = logging.getLogger("mindspeed.train")

__all__ = ["NonfiniteSteps", "StepResult", "TrainingError", "read_on_host"]


class TrainingError(MindSpeedError):
    """Training cannot go on (e.g. the loss stayed inf/nan)."""


class StepResult:
    """What one optimizer step reports.

    Its numbers stay where the step computed them (on the device) until one is read: the
    first read waits for the step to finish, once, and fetches all of them together. A loop
    that reads them only on its logging steps never makes the host wait for the device on
    the others. Reading one also settles the non-finite steps noted so far (`on_read`), which
    may raise `TrainingError`.

    Attributes (floats once read):
        loss: the step's objective over every rank (the model's aux losses left out).
        grad_norm: before clipping; nan when the step was skipped.
        num_units: the step's supervised units over every data-parallel rank.
        num_tokens: input tokens of the step over every data-parallel rank (an int).
        metrics: the objective's metric sums over the step's units (its `finish_metrics`
            applied), and the router's statistics.
    """

    def __init__(self, loss, grad_norm, num_units, num_tokens, metrics=None, *, extra=None,
                 finish=None, on_read=None):  # fmt: skip
        self._pending = {"loss": loss, "grad_norm": grad_norm, "num_units": num_units,
                         "num_tokens": num_tokens}  # fmt: skip
        self._pending_metrics = dict(metrics or {})
        self._extra, self._finish, self._on_read = dict(extra or {}), finish, on_read
        self._values: dict | None = None

    def _read(self) -> dict:
        if self._values is None:
            if self._on_read is not None:
                self._on_read()
            values = read_on_host({**self._pending, **{("metric", k): v for k, v in
                                                       self._pending_metrics.items()}})  # fmt: skip
            metrics = {k[1]: v for k, v in values.items() if isinstance(k, tuple)}
            if self._finish is not None:
                metrics = self._finish(metrics, values["num_units"])
            metrics.update(self._extra)
            self._values = {k: v for k, v in values.items() if isinstance(k, str)}
            self._values["num_tokens"] = int(self._values["num_tokens"])
            self._values["metrics"] = metrics
        return self._values

    @property
    def loss(self) -> float:
        return self._read()["loss"]

    @property
    def grad_norm(self) -> float:
        return self._read()["grad_norm"]

    @property
    def num_units(self) -> float:
        return self._read()["num_units"]

    @property
    def num_tokens(self) -> int:
        return self._read()["num_tokens"]

    @property
    def metrics(self) -> dict[str, float]:
        return self._read()["metrics"]


def read_on_host(values: dict) -> dict:
    """`values` with each tensor replaced by its float, the tensors of a device read in one
    transfer (one wait for the device, not one per value)."""
    tensors: dict[torch.device, list] = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            tensors.setdefault(value.device, []).append(key)
    out = dict(values)
    for keys in tensors.values():
        stacked = torch.stack([full(values[k]).detach().to(torch.float64).reshape(()) for k in keys])
        out.update(zip(keys, stacked.tolist(), strict=True))
    return out


class NonfiniteSteps:
    """Steps skipped for an inf/nan loss or gradient norm, noted as device flags and counted
    when read (`settle`): `state.extra`'s nonfinite_in_a_row and nonfinite_total, a warning
    per skipped step, and TrainingError once `max_in_a_row` came in a row."""

    def __init__(self, state: TrainState, max_in_a_row: int):
        self.state, self.max_in_a_row = state, max_in_a_row
        self._noted: list = []  # (step, loss, skipped flag), not read yet

    def note(self, step: int, loss: torch.Tensor, skipped: torch.Tensor) -> None:
        self._noted.append((step, loss.detach(), skipped))

    def settle(self) -> None:
        """Read the flags noted so far (one wait for the device) and count them."""
        noted, self._noted = self._noted, []
        if not noted:
            return
        table = torch.stack([torch.stack([full(loss).float(), found.to(loss.device).float()])
                             for _, loss, found in noted]).tolist()  # fmt: skip
        extra = self.state.extra
        for (step, _, _), (loss, skipped) in zip(noted, table, strict=True):
            if not skipped:
                extra["nonfinite_in_a_row"] = 0
                continue
            count = extra.get("nonfinite_in_a_row", 0) + 1
            extra["nonfinite_in_a_row"] = count
            extra["nonfinite_total"] = extra.get("nonfinite_total", 0) + 1
            logger.warning("step %d: loss is %s; skipped (%d in a row)", step, loss, count)
            if count >= self.max_in_a_row:
                raise TrainingError(
                    f"the loss was inf/nan for {count} steps in a row (up to step {step}); "
                    "lower optim.lr, raise optim.warmup_steps or use train.precision bf16/fp32"
                )
