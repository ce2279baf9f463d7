"""The colocated reference role: a frozen model under the run's layout (`placement.py`
places the other kind, a Ray actor; `lora.BaseReference` is this with the adapters off)."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from mindspeed_align.rl.objective import recompute_logps
from mindspeed_llm.data.collate import Batch

__all__ = ["LocalReference"]


class LocalReference:
    """The colocated reference: a frozen `BuiltModel` under the run's layout."""

    def __init__(self, model, *, supervised_only: bool = False):
        self.model, self.supervised_only = model, supervised_only

    def submit(self, batches: list[Batch], temperature: float) -> Callable[[], list[Tensor]]:
        """Log-probs of the batches' labels (the response positions alone projected where
        the layout allows), computed when the result is asked for."""
        return lambda: [recompute_logps(self.model, b, temperature, supervised_only=self.supervised_only)
                        for b in batches]  # fmt: skip
