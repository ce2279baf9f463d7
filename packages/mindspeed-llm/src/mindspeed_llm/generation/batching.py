"""Continuous batching: rows that decode together, joined by new prompts between steps and
left by finished ones, as a server needs.

    batch = DecodeBatch(model)
    logits = batch.join(["a", "b"], [[1, 5, 9], [1, 7]], budgets=[16, 16])  # (2, vocab)
    ... draw a token per row ...
    logits = batch.step({"a": 12, "b": 40})  # (rows, vocab), in batch.ids order
    batch.leave(["b"])

New prompts are prefilled in a batch of their own, then their keys and values join the
running cache aligned on its last column (`KVCache.concat`): the cache's key mask hides the
padding and each row keeps its own positions, so a row decodes what it would decode alone.
Drawing tokens is the caller's: `DecodeBatch` only runs the model.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch
from torch import Tensor, nn

from mindspeed_core.errors import DataError
from mindspeed_core.parallel import dtensor
from mindspeed_llm.generation.kv_cache import KVCache


class DecodeBatch:
    """The rows decoding together (see the module docstring). `ids` lists them in the order
    of the logits `step` returns."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.device = dtensor.local(model.tok_embeddings.weight).device
        self.context = model.config.max_position_embeddings
        self.ids: list[Hashable] = []
        self._remaining: list[int] = []  # tokens each row may still be fed
        self._cache: KVCache | None = None
        self._positions: Tensor | None = None  # (rows, 1)

    def __len__(self) -> int:
        return len(self.ids)

    @torch.inference_mode()
    def join(
        self, ids: Sequence[Hashable], prompts: Sequence[Sequence[int]], budgets: Sequence[int]
    ) -> Tensor:
        """Prefill `prompts` as new rows `ids`, each to generate up to `budgets` tokens;
        their next-token logits (len(prompts), vocab)."""
        if set(ids) & set(self.ids) or len(set(ids)) != len(ids):
            raise ValueError("row ids must be new and unique")
        lengths = [len(p) for p in prompts]
        for row, (length, budget) in enumerate(zip(lengths, budgets, strict=True)):
            if not length or budget < 1 or length + budget > self.context:
                raise DataError(
                    f"prompt {row}: {length} tokens and {budget} new ones do not fit the "
                    f"model's context of {self.context} positions"
                )
        longest = max(lengths)
        pads = [longest - n for n in lengths]
        tokens = torch.tensor([[0] * pad + list(p) for pad, p in zip(pads, prompts, strict=True)],
                              device=self.device)  # fmt: skip
        pad_t = torch.tensor(pads, device=self.device)[:, None]
        positions = (torch.arange(longest, device=self.device)[None, :] - pad_t).clamp_(min=0)
        room = max(budgets) - 1  # the last token drawn is never fed back
        cache = KVCache.for_model(self.model, len(prompts), longest + room)
        cache.reset(pads)
        logits = self.model(tokens, position_ids=positions, kv_cache=cache, logits_to_keep=1)
        new_positions = torch.tensor(lengths, device=self.device)[:, None]
        if self._cache is None:
            self._cache, self._positions = cache, new_positions
        else:
            room = max(max(self._remaining), room)
            self._cache = KVCache.concat(self._cache, cache, room)
            self._positions = torch.cat([self._positions, new_positions])
        self.ids += list(ids)
        self._remaining += [b - 1 for b in budgets]
        return dtensor.full(logits)[:, -1]

    @torch.inference_mode()
    def step(self, tokens: Mapping[Hashable, int]) -> Tensor:
        """Feed each row its last drawn token; the next-token logits (rows, vocab)."""
        if set(tokens) != set(self.ids):
            raise ValueError("step needs one token for every row of the batch")
        if any(r < 1 for r in self._remaining):
            raise ValueError("a row has used its budget: let it leave first")
        fed = torch.tensor([[tokens[i]] for i in self.ids], device=self.device)
        logits = self.model(fed, position_ids=self._positions, kv_cache=self._cache)
        self._positions = self._positions + 1
        self._remaining = [r - 1 for r in self._remaining]
        return dtensor.full(logits)[:, -1]

    def leave(self, ids: Sequence[Hashable]) -> None:
        """Take rows out of the batch (their keys and values are dropped)."""
        gone = set(ids)
        keep = [i for i, row in enumerate(self.ids) if row not in gone]
        if len(keep) == len(self.ids):
            return
        if not keep:
            self.ids, self._remaining, self._cache, self._positions = [], [], None, None
            return
        index = torch.tensor(keep, device=self.device)
        self._cache.keep_rows(index)
        self._positions = self._positions.index_select(0, index)
        self.ids = [self.ids[i] for i in keep]
        self._remaining = [self._remaining[i] for i in keep]
