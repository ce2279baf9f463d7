"""The decoder: embedding -> pre-norm blocks (dense or MoE) -> norm -> output projection.

Submodule names are torchtitan's (`tok_embeddings`, `layers.N.attention.wq`, ...), so
`tp_plan.llama_tp_plan` applies with its defaults. `layers` is a ModuleDict keyed
by layer index (the state-dict names are those of a ModuleList).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import mindspeed_ops
from mindspeed_core.checkpoint.saved import SavedParam
from mindspeed_core.parallel.materialize import ParamInit
from mindspeed_llm.models.common.attention import Attention, RopeTables
from mindspeed_llm.models.common.feed_forward import FeedForward
from mindspeed_llm.models.common.gated_deltanet import GatedDeltaNet
from mindspeed_llm.models.common.linear import Linear
from mindspeed_llm.models.common.mla import MultiLatentAttention
from mindspeed_llm.models.common.moe import AttachAux, GroupedExperts, MoE
from mindspeed_llm.models.common.mtp import MultiTokenPrediction, ahead_embeddings, mtp_loss
from mindspeed_llm.models.common.norm import RMSNorm
from mindspeed_llm.models.common.rope import rope_tables
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_ops import position_ids_from_cu_seqlens

if TYPE_CHECKING:
    from mindspeed_llm.generation.kv_cache import KVCache, LayerCache


class Block(nn.Module):
    """x + attention(norm(x)), then + feed_forward(norm(.))."""

    def __init__(self, layer_id: int, config: TransformerConfig):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = _norm(config)
        # DeepSeek-V2/V3: multi-head latent attention
        mla = config.kv_lora_rank is not None
        mixer = MultiLatentAttention if mla else Attention
        if layer_id in config.linear_attention_layers:  # Qwen3-Next: linear attention
            mixer = GatedDeltaNet
        self.attention = mixer(config, layer_id)
        self.ffn_norm = _norm(config)
        self.feed_forward = (
            MoE(config)
            if config.is_moe_layer(layer_id)
            else FeedForward(
                config.hidden_size,
                config.intermediate_size,
                impl=config.ops_impl,
                act=config.hidden_act,
            )
        )
        # Gemma 2: norms on the attention and feed-forward outputs too.
        self.post_attention_norm = _norm(config) if config.post_norms else None
        self.post_ffn_norm = _norm(config) if config.post_norms else None

    def init_weights(self, init: ParamInit, std: float) -> None:
        # torchtitan's depth scaling of the projections that write into the residual stream.
        out_std = std / math.sqrt(2 * (self.layer_id + 1))
        for norm in (
            self.attention_norm,
            self.ffn_norm,
            self.post_attention_norm,
            self.post_ffn_norm,
        ):
            if norm is not None:
                norm.init_params(init)
        self.attention.init_weights(init, std, out_std)
        self.feed_forward.init_weights(init, std, out_std)

    def forward(
        self,
        x: Tensor,
        rope: RopeTables,
        position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        *,
        kv_cache: LayerCache | None = None,
    ) -> Tensor:
        out = self.attention(
            self.attention_norm(x),
            rope,
            position_ids=position_ids,
            cu_seqlens=cu_seqlens,
            kv_cache=kv_cache,
        )
        if self.post_attention_norm is not None:
            out = self.post_attention_norm(out)
        h = x + out
        out = self.feed_forward(self.ffn_norm(h))
        if self.post_ffn_norm is not None:
            out = self.post_ffn_norm(out)
        return h + out


def _local_rope(config: TransformerConfig) -> TransformerConfig:
    """The config whose RoPE tables the sliding-window blocks use (`local_rope_theta`)."""
    return replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)


def _norm(config: TransformerConfig) -> RMSNorm:
    return RMSNorm(
        config.hidden_size, config.norm_eps, impl=config.ops_impl, offset=config.norm_unit_offset
    )


class Transformer(nn.Module):
    """A decoder-only language model described by a `TransformerConfig`: every block a
    SwiGLU feed-forward, or routed experts (`MoE`) where `config.is_moe_layer` says so.

    Build on the meta device and materialise later with::

        with torch.device("meta"):
            model = Transformer(config)
        model.to_empty(device=device)
        model.init_weights()
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.num_rows, config.hidden_size)
        self.layers = nn.ModuleDict({str(i): Block(i, config) for i in range(config.num_layers)})
        self.norm = _norm(config)
        self.output = Linear(config.hidden_size, config.num_rows, bias=False)
        if config.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.mtp = None  # DeepSeek-V3's multi-token prediction (`common.mtp`)
        self.last_mtp_loss: Tensor | None = None
        if config.num_nextn_predict_layers:
            self.mtp = MultiTokenPrediction(
                config, lambda i: Block(i, config), lambda: _norm(config)
            )
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if config.local_rope_theta is not None:  # Gemma 3: another RoPE for windowed blocks
            cos, sin = rope_tables(_local_rope(config))
            self.register_buffer("rope_local_cos", cos, persistent=False)
            self.register_buffer("rope_local_sin", sin, persistent=False)
        if self.rope_cos.device.type != "meta":
            self.init_weights()

    @torch.no_grad()
    def init_weights(
        self,
        buffer_device: torch.device | str | None = None,
        *,
        seed: int | None = None,
        skip: Iterable[str] = (),
    ) -> None:
        """Recompute the buffers (RoPE tables) and draw every parameter, each from a
        generator of its own (`mindspeed_core.parallel.ParamInit`).

        Embedding and input projections ~ N(0, init_std); the projections into the
        residual stream (wo, w2) ~ N(0, init_std / sqrt(2 * (layer_id + 1))); norms 1,
        biases 0; layers a hook added (a classifier head, adapters) by their own rules.
        Each parameter is drawn whole from `seed` and its name (stacked experts one expert
        at a time) and each rank keeps its shard, so a model parallelised on the meta
        device, then materialised, holds one process's weights in every layout, and a
        pipeline stage draws its layers without the others.

        Args:
            seed: the run's seed; None: `torch.initial_seed()` (what `torch.manual_seed` set).
            skip: parameter names filled otherwise (read from a checkpoint).
        """
        config = self.config
        tied = config.tie_word_embeddings and None not in (self.output, self.tok_embeddings)
        if tied and self.output.weight is not self.tok_embeddings.weight:
            # `to_empty` from the meta device materialises the two names separately.
            self.output.weight = self.tok_embeddings.weight
        device = buffer_device or self.rope_cos.device
        self.rope_cos, self.rope_sin = rope_tables(config, device)
        if config.local_rope_theta is not None:
            self.rope_local_cos, self.rope_local_sin = rope_tables(_local_rope(config), device)
        init = ParamInit(self, torch.initial_seed() if seed is None else seed, skip=skip)
        std, rows = config.init_std, config.vocab_size  # padding rows stay 0
        if self.tok_embeddings is not None:
            init.normal(self.tok_embeddings.weight, std, rows=rows)
        for layer in self.layers.values():
            layer.init_weights(init, std)
        if self.mtp is not None:
            self.mtp.init_weights(init, std)
        if self.norm is not None:
            self.norm.init_params(init)
        head = self.output  # the vocabulary's (a swapped head is drawn by `finish`)
        if head is not None and head.weight.shape[0] == config.num_rows:
            # A tied copy (the last pipeline stage's) draws as the embedding it copies.
            name = "tok_embeddings.weight" if config.tie_word_embeddings else None
            if not init.is_filled(head.weight):
                init.normal(head.weight, std, rows=rows, name=name)
        init.finish(self)  # a swapped head, adapters

    def forward(
        self,
        tokens: Tensor,
        position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        logits_to_keep: int = 0,
        return_hidden: bool = False,
        mtp_labels: Tensor | None = None,
        keep: Tensor | None = None,
        nll_labels: Tensor | None = None,
    ) -> Tensor:
        """Logits of the next token at every position.

        Args:
            tokens: (batch, seq) token ids.
            position_ids: (batch, seq) RoPE positions; default 0..seq-1 per row, or
                restarting at every document when `cu_seqlens` is given.
            cu_seqlens: int32 (num_docs + 1,) cumulative document lengths over the
                flattened batch * seq tokens (starting at 0, ending at batch * seq);
                attention stays inside each document.
            kv_cache: generation only (`mindspeed_llm.generation`): keys and values of
                earlier positions; `tokens` continue them at the cache's offset, which
                then moves on by seq. Give `position_ids` with it.
            logits_to_keep: n > 0: logits of the last n positions only (a prompt's
                prefill needs one, not seq x vocab); 0: every position.
            return_hidden: return the final-norm hidden states (batch, seq, hidden)
                instead of logits; `project` turns chosen positions into logits.
            mtp_labels: training a model with MTP modules: the batch's (batch, seq)
                labels; the forward also runs the MTP modules and keeps their weighted
                loss in `last_mtp_loss` (`common.mtp.take_mtp_loss`), as MoE keeps its
                router statistics, so the return value stays the logits.
            keep: (batch, seq) bool, or the flat indices (kept,) of those positions over
                batch * seq (no device sync to find them): the logits of those positions
                only, (kept, vocab), in the order given (row-major for a mask); a loss that reads few positions (SFT's replies, RL's
                responses) then never holds a (tokens x vocab) tensor for the rest.
            nll_labels: (batch, seq) labels (-100: ignored): return each position's
                -log p(label) instead of logits, (batch * seq,) fp32 (0 where ignored;
                (kept,) with `keep`), from the fused linear + cross-entropy op
                (`token_nll`): no logits exist at any position. Needs `fuses_nll`.

        Returns:
            (batch, seq, vocab_size) logits (vocab-sharded DTensor under loss parallel).

        A pipeline stage (`mindspeed_core.parallel.split_pipeline`) without
        `tok_embeddings` takes (batch, seq, hidden) hidden states as `tokens`, and one
        without `norm`/`output` returns hidden states; give such stages `position_ids`
        (under sequence parallel their hidden states hold a slice of the sequence). With
        MTP modules (on the last stage) those hidden states carry, after the hidden
        width, the first stage's `ahead_embeddings` of the tokens, and the last stage
        attaches its MTP loss to its output (`AttachAux`, scaled by `mtp.aux_grad_scale`).
        """
        depths = self._carried_depths()
        carried = None  # pipeline + MTP: the MTP modules' token embeddings ride along
        if self.tok_embeddings is None:
            h = tokens  # hidden states from the previous pipeline stage
            if depths:  # (batch, seq, (1 + depths) * hidden)
                h, carried = h.split(
                    [self.config.hidden_size, depths * self.config.hidden_size], -1
                )
        elif tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, seq), got shape {tuple(tokens.shape)}")
        else:
            h = self.tok_embeddings(tokens)  # (batch, seq, hidden)
            if self.config.scale_embeddings:  # Gemma: sqrt(hidden) rounded to h's dtype
                h = h * torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype).item()
            if depths:
                carried = ahead_embeddings(self, tokens, depths)
        if cu_seqlens is not None and position_ids is None:
            if not isinstance(cu_seqlens, Tensor):
                raise ValueError("shared prompts (SharedKeys) need explicit position_ids")
            position_ids = position_ids_from_cu_seqlens(cu_seqlens).view(h.shape[0], -1)
        rope = (self.rope_cos, self.rope_sin)
        local = None
        if self.config.local_rope_theta is not None:
            local = (self.rope_local_cos, self.rope_local_sin)
        for name, layer in self.layers.items():
            layer_cache = None if kv_cache is None else kv_cache.layer(int(name))
            slides = local is not None and layer.attention.sliding_window is not None
            h = layer(
                h,
                local if slides else rope,
                position_ids=position_ids,
                cu_seqlens=cu_seqlens,
                kv_cache=layer_cache,
            )
        if kv_cache is not None:
            kv_cache.advance(tokens.shape[1])
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None and carried is not None:  # to the next stage, with h
            return torch.cat([h, carried], -1)
        if mtp_labels is not None and self.mtp is not None:
            ids = None if carried is not None else tokens
            loss = mtp_loss(self, ids, mtp_labels, h, position_ids, cu_seqlens, embedded=carried)
            self.last_mtp_loss = loss
            if carried is not None:  # a pipeline's last stage: the loss rides on its output
                h = AttachAux.apply(h, loss * self.mtp.aux_grad_scale)
        if return_hidden:
            return h
        if nll_labels is not None:
            if keep is not None:
                h, nll_labels = kept_positions(h, keep), kept_positions(nll_labels, keep)
            return self.token_nll(h, nll_labels)
        if keep is not None and self.output is not None:
            return self.project(kept_positions(h, keep))
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        return h if self.output is None else self.project(h)

    def _carried_depths(self) -> int:
        """MTP depths whose token embeddings a pipeline stage passes on (0: none); a
        stage lacks the embedding or the output projection."""
        if None not in (self.tok_embeddings, self.output):
            return 0
        return self.config.num_nextn_predict_layers

    def project(self, h: Tensor) -> Tensor:
        """Logits (..., vocab) of final-norm hidden states (..., hidden): the output
        projection, then `final_logit_softcapping` if set."""
        logits = self.output(h)
        cap = self.config.final_logit_softcapping
        logits = logits if cap is None else cap * torch.tanh(logits / cap)
        return self._without_padding(logits)

    @property
    def fuses_nll(self) -> bool:
        """Whether `token_nll` can run: this module holds the plain output projection (no
        adapter on it, no bias) and no softcapping bends its logits."""
        out = self.output
        # an adapter (LoRA's `lora_A`/`lora_B`, run by a forward hook) would be skipped by the
        # fused op, which reads output.weight alone
        return bool(type(out) is Linear and out.bias is None and not hasattr(out, "lora_A")
                    and self.config.final_logit_softcapping is None)  # fmt: skip

    def token_nll(self, h: Tensor, labels: Tensor) -> Tensor:
        """(tokens,) fp32 -log p(label) of final-norm hidden states (..., hidden) against
        (...) labels, 0 where a label is -100: `mindspeed_ops.linear_cross_entropy` over
        the real vocabulary's rows, chunk by chunk, so no (tokens x vocab) logits are held
        forward or backward. Under autocast it computes in the autocast dtype, as the
        projection would."""
        weight = self.output.weight if self.fuses_nll else None
        if weight is None or isinstance(weight, DTensor):
            raise ValueError("token_nll needs the whole, plain output projection (no tensor "
                             "parallel, adapter, bias or softcapping on it)")  # fmt: skip
        device = h.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
        weight = weight[: self.config.vocab_size]  # padding rows are no class (contiguous)
        return mindspeed_ops.linear_cross_entropy(
            h.reshape(-1, h.shape[-1]).to(dtype), weight.to(dtype), labels.flatten(),
            reduction="none", impl=self.config.ops_impl,
        )  # fmt: skip

    def _without_padding(self, logits: Tensor) -> Tensor:
        """A padded vocabulary's logits (`config.padded_vocab_size`) cut off, or masked
        where they stay sharded over the vocabulary (loss parallel)."""
        vocab, rows = self.config.vocab_size, self.config.num_rows
        if rows == vocab or logits.shape[-1] != rows:
            return logits  # nothing padded, or a head that is not the vocabulary's
        if not isinstance(logits, DTensor):
            return logits[..., :vocab]
        return mask_vocab_padding(logits, vocab)

    def hidden_matrices(self) -> list[str]:
        """The parameters Muon orthogonalises (`mindspeed_core.optim.muon`): the weights of
        the blocks' projections (attention, MLP, shared experts, MTP modules) and the
        stacked routed-expert matrices. The embedding and output head stay with AdamW (as
        Moonshot and Keller Jordan do), and so do norms, biases, convolutions, routers and
        one-output gates: a router's rows are the experts' logits, whose scale sets how
        sharply it routes, and a single row orthogonalised is only its normalised gradient."""
        names = []
        for root in ("layers", "mtp"):
            module = getattr(self, root)
            for name, sub in module.named_modules(prefix=root) if module is not None else ():
                if isinstance(sub, nn.Linear) and min(sub.weight.shape) > 1:
                    names.append(f"{name}.weight")
                elif isinstance(sub, GroupedExperts):
                    names += [f"{name}.{w}" for w in ("w1", "w2", "w3")]
        return names

    def saved_params(self) -> dict[str, SavedParam]:
        """How checkpoints hold the vocabulary matrices (`mindspeed_core.checkpoint.saved`):
        vocab_size rows of a padded embedding and output projection, so they load under
        any tensor parallel; and the optimizer state of a tied output projection that a
        pipeline stage holds as its own copy under the embedding's name (one process's)."""
        config, out = self.config, {}
        rows = config.vocab_size if config.num_rows > config.vocab_size else None
        heads = (("tok_embeddings", self.tok_embeddings), ("output", self.output))
        for name, module in heads:
            if module is None or module.weight.shape[0] != config.num_rows:
                continue
            own = f"{name}.weight"
            copy = name == "output" and config.tie_word_embeddings and self.tok_embeddings is None
            if copy:
                out[own] = SavedParam("tok_embeddings.weight", rows, optimizer_only=True)
            elif rows:
                out[own] = SavedParam(own, rows)
        return out


def kept_positions(t: Tensor, keep: Tensor) -> Tensor:
    """The positions of t (batch, seq, ...) that `keep` picks, (kept, ...): a (batch, seq)
    bool mask (its output size is read from the device: a sync on an accelerator) or
    int64 indices over the flattened batch * seq positions (none)."""
    flat = t.flatten(0, 1)
    return flat[keep.flatten()] if keep.dtype == torch.bool else flat.index_select(0, keep)


def mask_vocab_padding(logits: DTensor, vocab: int) -> DTensor:
    """Logits sharded evenly over the vocabulary (Shard(-1) on a 1-D mesh) with the
    columns from `vocab` on set to the dtype's lowest value: a softmax gives them exactly
    0 (no gradient, never sampled), and unlike -inf an entropy (p * log p) stays finite."""
    local = logits.to_local()
    width = local.shape[-1]
    start = logits.device_mesh.get_local_rank() * width
    if start + width <= vocab:
        return logits
    columns = torch.arange(start, start + width, device=local.device)
    local = local.masked_fill(columns >= vocab, torch.finfo(local.dtype).min)
    return DTensor.from_local(
        local, logits.device_mesh, logits.placements, run_check=False,
        shape=logits.shape, stride=logits.stride(),
    )  # fmt: skip
