"""How a step reads the output layer: logits at every position, logits at the supervised
positions only (`Objective.supervised_logits_only`), or each token's nll from the fused
linear + cross-entropy op (`train.fused_linear_cross_entropy`), as the layout allows."""

from __future__ import annotations

from mindspeed_core.errors import ConfigError

__all__ = ["FUSED_CE_AUTO_BYTES", "FUSED_CE_MODES", "fused_ce_mode", "fuses_tokens",
           "supervised_positions_layout"]  # fmt: skip


def supervised_positions_layout(model, dims) -> bool:
    """Whether `model` (a `BuiltModel`) under `dims` can project the supervised positions
    alone (`Transformer.forward(keep=)`): one whole model (no pipeline stages) whose hidden
    states are plain tensors (no tensor or context parallel) and no vocab-sharded loss."""
    return bool(model.pipeline is None and dims.tp == 1 and dims.cp == 1
                and not model.loss.loss_parallel)  # fmt: skip


FUSED_CE_AUTO_BYTES = 1 << 30
"""`fused_linear_cross_entropy: auto` fuses a micro-batch whose fp32 logits take this much."""
FUSED_CE_MODES = ("auto", "on", "off")


def fused_ce_mode(mode: str, objective, model, dims) -> str:
    """`mode`, or "off" where "auto" cannot fuse; ConfigError where "on" cannot."""
    if mode not in FUSED_CE_MODES:
        raise ConfigError(f"train.fused_linear_cross_entropy={mode!r} is not one of "
                          f"{FUSED_CE_MODES}")  # fmt: skip
    if mode == "off":
        return mode
    why = None
    if not getattr(objective, "reads_token_nll_only", False):
        why = f"this run's loss ({type(objective).__name__}) reads the logits themselves"
    elif model.pipeline is not None:
        why = "pipeline parallel"
    elif dims.tp > 1 or model.loss.loss_parallel:
        why = "tensor parallel (the output layer is sharded over the vocabulary)"
    elif not model.model.fuses_nll:
        why = "an output layer with an adapter, a bias or logit softcapping"
    if why is None:
        return mode
    if mode == "on":
        raise ConfigError(f"train.fused_linear_cross_entropy=on cannot run here: {why}")
    return "off"


def fuses_tokens(mode: str, tokens: int, vocab: int) -> bool:
    """Whether a micro-batch of `tokens` projected positions goes through the fused op
    under `mode` (as `fused_ce_mode` resolved it)."""
    if mode != "auto":
        return mode == "on"
    return tokens * vocab * 4 >= FUSED_CE_AUTO_BYTES
