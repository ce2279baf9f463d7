"""Cross entropy computed in chunks of tokens, so full fp32 logits never exist at once.

`cross_entropy(logits, target)` keeps only the per-token fp32 log-sum-exp between forward
and backward and recomputes each chunk's softmax in backward. `linear_cross_entropy(hidden,
weight, target)` goes further: it never builds the logits at all, only one chunk of them,
and accumulates the weight gradient in fp32.
Label smoothing follows torch: loss = (1 - s) * nll + s * mean over classes of -log p.
The returned loss is fp32; `reduction="mean"` divides by the number of non-ignored tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mindspeed_ops.backends import resolve_impl
from mindspeed_ops.validate import check_float, check_index, check_same_device, on_host

REDUCTIONS = ("mean", "sum", "none")
# fp32 elements of one chunk of logits: 16 MiB on CPU; 256 MiB on accelerators, where each
# chunk is a few kernel launches and small chunks would be launch-bound.
# The fused variant uses 64 MiB chunks on CPU: each chunk rereads the whole output weight in
# three GEMMs, and narrow GEMMs are slow.
_CHUNK_ELEMENTS = {"cpu": 1 << 22}
_LINEAR_CHUNK_ELEMENTS = {"cpu": 1 << 24}
_CHUNK_ELEMENTS_ACCELERATOR = 1 << 26


def _chunk_rows(vocab: int, chunk_size: int | None, backend: str, linear: bool = False) -> int:
    if chunk_size:
        return chunk_size
    table = _LINEAR_CHUNK_ELEMENTS if linear else _CHUNK_ELEMENTS
    return max(1, table.get(backend, _CHUNK_ELEMENTS_ACCELERATOR) // vocab)


def _chunk_loss(z: Tensor, target: Tensor, ignore_index: int, smoothing: float):
    """fp32 logits chunk -> (per-token loss, lse); ignored tokens get 0."""
    lse = z.logsumexp(-1)
    valid = target != ignore_index
    picked = z.gather(1, torch.where(valid, target, 0)[:, None]).squeeze(1)
    loss = lse - (1.0 - smoothing) * picked
    if smoothing:
        loss = loss - smoothing * z.mean(-1)
    return torch.where(valid, loss, 0.0), lse


def _chunk_grad(z: Tensor, target: Tensor, lse: Tensor, dloss: Tensor, ignore_index, smoothing):
    """fp32 d loss / d logits for one chunk, in place on z."""
    valid = target != ignore_index
    grad = z.sub_(lse[:, None]).exp_()
    grad.scatter_add_(
        1, torch.where(valid, target, 0)[:, None], grad.new_full((len(z), 1), smoothing - 1.0)
    )
    if smoothing:
        grad.sub_(smoothing / z.shape[1])
    return grad.mul_(torch.where(valid, dloss, 0.0)[:, None])


@torch.library.custom_op("mindspeed::cross_entropy_fwd", mutates_args=())
def _ce_fwd(
    logits: Tensor, target: Tensor, ignore_index: int, smoothing: float, chunk: int
) -> tuple[Tensor, Tensor]:
    _check_target_values(target, logits.shape[1], ignore_index)
    loss = logits.new_empty(len(logits), dtype=torch.float32)
    lse = torch.empty_like(loss)
    for a in range(0, len(logits), chunk):
        loss[a : a + chunk], lse[a : a + chunk] = _chunk_loss(
            logits[a : a + chunk].float(), target[a : a + chunk], ignore_index, smoothing
        )
    return loss, lse


@_ce_fwd.register_fake
def _(logits, target, ignore_index, smoothing, chunk):
    return tuple(logits.new_empty(len(logits), dtype=torch.float32) for _ in range(2))


@torch.library.custom_op("mindspeed::cross_entropy_bwd", mutates_args=())
def _ce_bwd(
    dloss: Tensor,
    logits: Tensor,
    target: Tensor,
    lse: Tensor,
    ignore_index: int,
    smoothing: float,
    chunk: int,
) -> Tensor:
    dlogits = torch.empty_like(logits)
    for a in range(0, len(logits), chunk):
        sl = slice(a, a + chunk)
        z = logits[sl].to(torch.float32, copy=True)  # _chunk_grad works in place
        dlogits[sl] = _chunk_grad(z, target[sl], lse[sl], dloss[sl], ignore_index, smoothing)
    return dlogits


@_ce_bwd.register_fake
def _(dloss, logits, target, lse, ignore_index, smoothing, chunk):
    return torch.empty_like(logits)


def _ce_setup(ctx, inputs, output):
    logits, target, ignore_index, smoothing, chunk = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.args = (ignore_index, smoothing, chunk)


def _ce_backward(ctx, dloss, _dlse):
    logits, target, lse = ctx.saved_tensors
    return _ce_bwd(dloss.contiguous(), logits, target, lse, *ctx.args), None, None, None, None


_ce_fwd.register_autograd(_ce_backward, setup_context=_ce_setup)


@torch.library.custom_op("mindspeed::linear_cross_entropy_fwd", mutates_args=())
def _lce_fwd(
    hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, smoothing: float, chunk: int
) -> tuple[Tensor, Tensor]:
    _check_target_values(target, weight.shape[0], ignore_index)
    loss = hidden.new_empty(len(hidden), dtype=torch.float32)
    lse = torch.empty_like(loss)
    for a in range(0, len(hidden), chunk):
        z = (hidden[a : a + chunk] @ weight.t()).float()
        loss[a : a + chunk], lse[a : a + chunk] = _chunk_loss(
            z, target[a : a + chunk], ignore_index, smoothing
        )
    return loss, lse


@_lce_fwd.register_fake
def _(hidden, weight, target, ignore_index, smoothing, chunk):
    return tuple(hidden.new_empty(len(hidden), dtype=torch.float32) for _ in range(2))


@torch.library.custom_op("mindspeed::linear_cross_entropy_bwd", mutates_args=())
def _lce_bwd(
    dloss: Tensor,
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    lse: Tensor,
    ignore_index: int,
    smoothing: float,
    chunk: int,
) -> tuple[Tensor, Tensor]:
    dhidden = torch.empty_like(hidden)
    dweight = torch.zeros_like(weight, dtype=torch.float32)
    for a in range(0, len(hidden), chunk):
        sl = slice(a, a + chunk)
        z = (hidden[sl] @ weight.t()).float()
        dz = _chunk_grad(z, target[sl], lse[sl], dloss[sl], ignore_index, smoothing)
        dhidden[sl] = dz.to(hidden.dtype) @ weight
        dweight.addmm_(dz.t(), hidden[sl].float())
    return dhidden, dweight.to(weight.dtype)


@_lce_bwd.register_fake
def _(dloss, hidden, weight, target, lse, ignore_index, smoothing, chunk):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _lce_setup(ctx, inputs, output):
    hidden, weight, target, ignore_index, smoothing, chunk = inputs
    ctx.save_for_backward(hidden, weight, target, output[1])
    ctx.args = (ignore_index, smoothing, chunk)


def _lce_backward(ctx, dloss, _dlse):
    hidden, weight, target, lse = ctx.saved_tensors
    dh, dw = _lce_bwd(dloss.contiguous(), hidden, weight, target, lse, *ctx.args)
    return dh, dw, None, None, None, None


_lce_fwd.register_autograd(_lce_backward, setup_context=_lce_setup)


def _reduce(loss: Tensor, target: Tensor, ignore_index: int, reduction: str) -> Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()


def _validate_common(target, rows, ignore_index, label_smoothing, reduction, ref):
    check_index("target", target)
    check_same_device("target", target, ref)
    if tuple(target.shape) != (rows,):
        raise ValueError(f"target shape {tuple(target.shape)} != ({rows},) tokens")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {REDUCTIONS}")


def _check_target_values(target: Tensor, vocab: int, ignore_index: int) -> None:
    """Targets are classes or ignore_index. Checked where it costs no device sync: on host
    tensors (in the kernels' bodies and the reference); an accelerator's kernel fails on a
    bad target in its gather, as torch's own cross entropy does."""
    if torch.compiler.is_compiling() or not on_host(target):
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        value = int(target[bad][0])
        raise ValueError(f"target holds {value}, outside [0, {vocab}) and not ignore_index")


def cross_entropy_reference(logits, target, *, ignore_index=-100, label_smoothing=0.0,
                            reduction="mean"):  # fmt: skip
    """The oracle: torch's cross entropy on fp32 logits."""
    return F.cross_entropy(
        logits.float(),
        target.long(),
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction=reduction,
    )


def cross_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    impl: str = "auto",
) -> Tensor:
    """Cross entropy of (tokens, vocab) logits against (tokens,) class indices.

    Args:
        chunk_size: tokens per chunk; default keeps one fp32 chunk of logits near 16 MiB on
            CPU and 256 MiB on GPU/NPU.
        impl: "auto", "reference", "cpu", "cuda" or "npu" (all but the reference run the
            chunked composed kernel).
    """
    check_float("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits must be (tokens, vocab), got shape {tuple(logits.shape)}")
    _validate_common(target, len(logits), ignore_index, label_smoothing, reduction, logits)
    backend = resolve_impl(impl, logits)
    if backend == "reference":
        _check_target_values(target, logits.shape[1], ignore_index)
        return cross_entropy_reference(
            logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
            reduction=reduction,
        )  # fmt: skip
    chunk = _chunk_rows(logits.shape[1], chunk_size, backend)
    loss, _ = _ce_fwd(
        logits.contiguous(), target.long(), ignore_index, float(label_smoothing), chunk
    )
    return _reduce(loss, target, ignore_index, reduction)


def linear_cross_entropy_reference(hidden, weight, target, **kwargs):
    """The oracle for the fused variant: full logits, then cross entropy."""
    return cross_entropy_reference(hidden @ weight.t(), target, **kwargs)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    impl: str = "auto",
) -> Tensor:
    """Cross entropy of `hidden @ weight.T` (the output projection) without building the logits.

    Args:
        hidden: (tokens, hidden_size).
        chunk_size: tokens per chunk; default keeps one fp32 chunk of logits near 64 MiB on
            CPU and 256 MiB on GPU/NPU.
        weight: (vocab, hidden_size), same dtype as hidden.
        target: (tokens,) class indices.
    """
    check_float("hidden", hidden)
    check_float("weight", weight)
    check_same_device("weight", weight, hidden)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be (tokens, h) and weight {tuple(weight.shape)} "
            "(vocab, h)"
        )
    if hidden.dtype != weight.dtype:
        raise TypeError(f"weight has dtype {weight.dtype} but hidden has {hidden.dtype}")
    _validate_common(target, len(hidden), ignore_index, label_smoothing, reduction, hidden)
    backend = resolve_impl(impl, hidden)
    kwargs = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction)
    if backend == "reference":
        _check_target_values(target, weight.shape[0], ignore_index)
        return linear_cross_entropy_reference(hidden, weight, target, **kwargs)
    chunk = _chunk_rows(weight.shape[0], chunk_size, backend, linear=True)
    loss, _ = _lce_fwd(
        hidden.contiguous(), weight.contiguous(), target.long(), ignore_index,
        float(label_smoothing), chunk,
    )  # fmt: skip
    return _reduce(loss, target, ignore_index, reduction)
