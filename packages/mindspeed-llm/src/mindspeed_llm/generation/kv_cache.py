"""A key/value cache allocated once: (batch, kv_heads, max_len, head_dim) per layer.

Every row of a batch shares one write offset. Prompts of different lengths are padded on
the left, so their ends line up and each decode step writes one column for all rows; the
cache's key mask hides the padding from every query.

Under tensor parallel each rank caches its own heads only (the q/k/v projections are
column-sharded, so attention sees local heads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mindspeed_core.parallel import dtensor


class KVCache:
    """Keys and values of `num_layers` layers for `batch` rows of up to `max_len` positions.

    Pass it to `Transformer.forward(tokens, position_ids, kv_cache=cache)`: the new
    tokens are written at `offset`, attend to everything before them, and `offset`
    moves on by their number.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        batch: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        # Uninitialised: attention reads only the positions written so far.
        shape = (batch, num_kv_heads, max_len, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._layers = [LayerCache(self, i) for i in range(num_layers)]
        self.batch, self.max_len = batch, max_len
        self.offset = 0
        self.key_mask: Tensor | None = None  # (batch, max_len) bool; None: no padding
        # DeepSeek sparse attention: layer -> its indexer's keys (batch, max_len, d)
        self.indexer_keys: dict[int, Tensor] = {}
        # Recurrent layers (gated DeltaNet): layer -> (conv inputs, state), one row each.
        self.states: dict[int, tuple[Tensor | None, Tensor | None]] = {}
        self._mask_for: tuple | None = None  # (offset, seq, window) of the cached mask
        self._mask: Tensor | None = None

    @classmethod
    def for_model(cls, model: nn.Module, batch: int, max_len: int) -> KVCache:
        """A cache shaped for `model` (a `Transformer`, whole or tensor parallel)."""
        return cls(batch=batch, max_len=max_len, **cls._layout(model))

    @classmethod
    def bytes_per_position(cls, model: nn.Module) -> int:
        """Bytes one row's keys and values take per position over every layer (this
        rank's heads): a memory budget's unit."""
        layout = cls._layout(model)
        itemsize = torch.empty((), dtype=layout["dtype"]).element_size()
        return 2 * layout["num_layers"] * layout["num_kv_heads"] * layout["head_dim"] * itemsize

    @staticmethod
    def _layout(model: nn.Module) -> dict:
        config = model.config
        mixers = [layer.attention for layer in model.layers.values()]
        # the first softmax attention (a hybrid model's linear layers keep states instead)
        attention = next((m for m in mixers if hasattr(m, "wk") or hasattr(m, "kv_cache_layout")),
                         mixers[0])  # fmt: skip
        if hasattr(attention, "kv_cache_layout"):  # e.g. latent attention: its own widths
            heads, head_dim, dtype, device = attention.kv_cache_layout()
        else:
            local = dtensor.local(attention.wk.weight)
            # An int8 weight-only layer (`generation.quantize`) computes in the activations'
            # dtype: that of the model's float parameters (embeddings, norms), not its scale's.
            dtype = local.dtype if local.is_floating_point() else next(
                p.dtype for p in model.parameters() if p.is_floating_point()
            )
            heads, head_dim, device = local.shape[0] // config.head_dim, config.head_dim, local.device
        return {"num_layers": config.num_layers, "num_kv_heads": heads, "head_dim": head_dim,
                "dtype": dtype, "device": device}  # fmt: skip

    def reset(self, pad_lengths: list[int] | None = None) -> None:
        """Start over (offset 0); row i begins with `pad_lengths[i]` padding positions."""
        self.offset = 0
        self._mask_for = self._mask = None
        self.indexer_keys = {}
        self.states = {}
        if pad_lengths is None or not any(pad_lengths):
            self.key_mask = None
            return
        device = self.keys[0].device
        pads = torch.tensor(pad_lengths, device=device)[:, None]
        self.key_mask = torch.arange(self.max_len, device=device)[None, :] >= pads

    def repeat_rows(self, n: int) -> None:
        """Each row becomes n consecutive rows holding its keys and values (n samples
        sharing one prefill)."""
        if n == 1:
            return
        self.keys = [k.repeat_interleave(n, dim=0) for k in self.keys]
        self.values = [v.repeat_interleave(n, dim=0) for v in self.values]
        self.indexer_keys = {i: t.repeat_interleave(n, dim=0) for i, t in self.indexer_keys.items()}
        self.states = {i: _rows(s, lambda t: t.repeat_interleave(n, dim=0))
                       for i, s in self.states.items()}  # fmt: skip
        if self.key_mask is not None:
            self.key_mask = self.key_mask.repeat_interleave(n, dim=0)
        self.batch *= n
        self._mask_for = self._mask = None

    def keep_rows(self, index: Tensor) -> None:
        """Keep only the rows `index` (in that order): finished rows leave the batch."""
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        self.indexer_keys = {i: t.index_select(0, index) for i, t in self.indexer_keys.items()}
        self.states = {i: _rows(s, lambda t: t.index_select(0, index))
                       for i, s in self.states.items()}  # fmt: skip
        if self.key_mask is not None:
            self.key_mask = self.key_mask.index_select(0, index)
        self.batch = int(index.numel())
        self._mask_for = self._mask = None

    def starts(self) -> Tensor:
        """(batch,) the first position of each row that is not padding."""
        if self.key_mask is None:
            return torch.zeros(self.batch, dtype=torch.long, device=self.keys[0].device)
        return (~self.key_mask[:, : self.offset]).sum(dim=1)

    @classmethod
    def concat(cls, first: KVCache, second: KVCache, room: int) -> KVCache:
        """One cache holding `first`'s rows, then `second`'s, aligned on their last written
        column (the shorter one left-padded), with the columns no row uses trimmed, and
        `room` free columns after the written ones: how rows join a running batch."""
        if first.indexer_keys or second.indexer_keys:
            raise NotImplementedError(
                "rows joining a running batch (KVCache.concat) with DeepSeek sparse attention's "
                "indexer keys are not supported yet"
            )
        end = max(first.offset, second.offset)
        shifts = [end - first.offset, end - second.offset]
        starts = torch.cat([first.starts() + shifts[0], second.starts() + shifts[1]])
        trim = int(starts.min())
        offset = end - trim
        batch = first.batch + second.batch
        merged = cls.__new__(cls)
        merged.keys, merged.values = [], []
        for name in ("keys", "values"):
            for a, b in zip(getattr(first, name), getattr(second, name), strict=True):
                out = a.new_zeros(batch, a.shape[1], offset + room, a.shape[3])
                rows = ((slice(0, first.batch), a, shifts[0], first.offset),
                        (slice(first.batch, batch), b, shifts[1], second.offset))  # fmt: skip
                for row_slice, cache, shift, written in rows:
                    # column j of that cache lands at j + shift - trim; before `src` every
                    # one of its rows holds padding
                    src = max(0, trim - shift)
                    out[row_slice, :, src + shift - trim : offset] = cache[:, :, src:written]
                getattr(merged, name).append(out)
        merged._layers = [LayerCache(merged, i) for i in range(len(merged.keys))]
        merged.states = {  # a recurrent state belongs to its row, whatever its columns
            i: tuple(None if a is None else torch.cat([a, b]) for a, b in zip(s, second.states[i], strict=True))
            for i, s in first.states.items()
        }
        merged.batch, merged.max_len, merged.offset = batch, offset + room, offset
        merged.indexer_keys = {}
        starts = starts - trim
        positions = torch.arange(offset + room, device=starts.device)[None, :]
        merged.key_mask = positions >= starts[:, None] if bool(starts.any()) else None
        merged._mask_for = merged._mask = None
        return merged

    def layer(self, index: int) -> LayerCache:
        return self._layers[index]

    def advance(self, num_tokens: int) -> None:
        self.offset += num_tokens
        self._mask_for = self._mask = None

    def attend(
        self,
        index: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        window: int | None = None,
        *,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
        select: Tensor | None = None,
    ) -> Tensor:
        """Write k, v (batch, seq, kv_heads, head_dim) of layer `index` at the offset and
        attend q (batch, seq, heads, head_dim) to the cache up to them; same shape as q.
        `scale`: of the scores (default head_dim ** -0.5); `softcap`: scores -> softcap *
        tanh(scores / softcap) before the mask (Gemma 2); `sinks`: (heads,) logits in every
        row's softmax denominator (gpt-oss); these two in plain PyTorch. `select`: (batch,
        seq, offset + seq) bool, the keys each query may see on top of the cache's own mask
        (DeepSeek sparse attention's choice)."""
        seq = q.shape[1]
        start, end = self.offset, self.offset + seq
        if end > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} positions is full (offset {start})")
        keys, values = self.keys[index], self.values[index]
        keys[:, :, start:end] = k.transpose(1, 2)
        values[:, :, start:end] = v.transpose(1, 2)
        mask = self._attention_mask(seq, window, q.device)
        if select is not None:
            mask = (self.visible_mask(seq, q.device) if mask is None else mask) & select[:, None]
        if softcap is not None or sinks is not None:
            return _plain(q, keys[:, :, :end], values[:, :, :end], mask, scale, softcap, sinks)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),  # (batch, heads, seq, head_dim)
            keys[:, :, :end],
            values[:, :, :end],
            attn_mask=mask,
            is_causal=mask is None and seq > 1,
            enable_gqa=q.shape[2] != k.shape[2],
            scale=scale,
        )
        return out.transpose(1, 2)

    def visible_mask(self, seq: int, device: torch.device) -> Tensor:
        """(batch or 1, 1, seq, offset + seq) bool: what the next `seq` queries may see
        (causal, padding hidden), never None."""
        mask = self._attention_mask(seq, None, device)
        if mask is None:
            start, end = self.offset, self.offset + seq
            i = torch.arange(start, end, device=device)[:, None]
            mask = (torch.arange(end, device=device)[None, :] <= i)[None, None]
        return mask

    def _attention_mask(self, seq: int, window: int | None, device: torch.device) -> Tensor | None:
        """bool (batch or 1, 1, seq, offset + seq): may the query see the key; None when
        plain causal attention from offset 0 (or one query with nothing hidden) says it."""
        start, end = self.offset, self.offset + seq
        if self.key_mask is None and window is None and (start == 0 or seq == 1):
            return None
        if self._mask_for != (start, seq, window):
            i = torch.arange(start, end, device=device)[:, None]  # query positions
            j = torch.arange(end, device=device)[None, :]  # key positions
            allowed = j <= i
            if window is not None:
                allowed = allowed & (i - j < window)
            if self.key_mask is not None:
                # A padding query sees itself only, so its output stays finite.
                allowed = (allowed & self.key_mask[:, None, :end]) | (i == j)
            self._mask = allowed.unsqueeze(-3)
            self._mask_for = (start, seq, window)
        return self._mask


def _rows(state: tuple, fn) -> tuple:
    return tuple(None if t is None else fn(t) for t in state)


def _plain(q, keys, values, mask, scale, softcap, sinks) -> Tensor:
    """Attention of q (batch, seq, heads, d) to cached keys/values (batch, kv_heads, len, d)
    under a bool mask (None: causal from offset 0), with soft-capped scores and/or sinks."""
    group = q.shape[2] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q.float().transpose(1, 2) @ keys.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is None:
        seq, length = scores.shape[-2:]
        mask = torch.ones(seq, length, dtype=torch.bool, device=q.device).tril(length - seq)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # a last column per head: the sink, dropped after the softmax
        sink = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return (probs @ values).transpose(1, 2).to(q.dtype)


class LayerCache:
    """One layer's view of a `KVCache` (what `Attention.forward` receives)."""

    __slots__ = ("cache", "index")

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def attend(self, q: Tensor, k: Tensor, v: Tensor, window: int | None = None, **kw) -> Tensor:
        return self.cache.attend(self.index, q, k, v, window, **kw)

    def index_keys(self, keys: Tensor) -> Tensor:
        """Write this layer's indexer keys (batch, seq, d) at the offset; -> all of them so
        far (batch, offset + seq, d)."""
        cache = self.cache
        store = cache.indexer_keys.get(self.index)
        if store is None:
            store = keys.new_zeros(cache.batch, cache.max_len, keys.shape[-1])
            cache.indexer_keys[self.index] = store
        end = cache.offset + keys.shape[1]
        store[:, cache.offset : end] = keys
        return store[:, :end]

    def visible(self, seq: int) -> Tensor:
        """(batch or 1, seq, offset + seq) bool: the cached keys the next queries may see."""
        return self.cache.visible_mask(seq, self.cache.keys[0].device)[:, 0]
    @property
    def state(self) -> tuple[Tensor | None, Tensor | None] | None:
        """A recurrent layer's (conv inputs, state) after the tokens so far; None at first."""
        return self.cache.states.get(self.index)

    @state.setter
    def state(self, value: tuple[Tensor | None, Tensor | None]) -> None:
        self.cache.states[self.index] = value

    def new_positions_mask(self, seq: int) -> Tensor | None:
        """(batch, seq) bool: which of the `seq` positions about to be written are not
        left padding; None when no row is padded."""
        mask = self.cache.key_mask
        return None if mask is None else mask[:, self.cache.offset : self.cache.offset + seq]
