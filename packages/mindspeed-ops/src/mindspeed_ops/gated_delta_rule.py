"""The gated delta rule: Gated DeltaNet's linear attention (Yang et al., "Gated Delta Networks"),
the token mixer of Qwen3-Next's and Qwen3.5's linear-attention layers.

Per sequence and value head a state S (dk, dv) starts at zero (or `initial_state`) and each
token t, with log decay g_t and write strength beta_t, does

    S <- e^{g_t} S;    S <- S + k_t (beta_t (v_t - S^T k_t))^T;    o_t = S^T q_t,

with q (and k) first L2-normalised when `use_qk_l2norm` and q scaled by dk^-0.5: the
conventions of transformers' `torch_recurrent_gated_delta_rule` and flash-linear-attention.

Layouts: batched q, k (batch, seq, heads_k, dk), v (batch, seq, heads_v, dv), g and beta
(batch, seq, heads_v); or packed q, k (tokens, heads_k, dk), ... with `cu_seqlens` (num_seqs +
1,) cumulative document lengths starting at 0, as `attention` takes them: the state restarts at
each document. heads_v is a multiple of heads_k; key head h serves value heads
h * r ... (h + 1) * r - 1, r = heads_v // heads_k. States are (num_seqs, heads_v, dk, dv), fp32
(fp64 for fp64 inputs); outputs have q's dtype. g > 0 is allowed (the state then grows) and
g, beta are not range-checked: looking at values would cost a device sync per call.

Backends: reference is the token-by-token loop; "cpu" and "npu" run the chunked PyTorch
algorithm (`gated_delta_chunk.py`: no fused NPU kernel is wired yet); "cuda" calls
flash-linear-attention's `chunk_gated_delta_rule` when `fla` is installed, else the chunked
PyTorch algorithm. Not built: context-parallel state passing between ranks, DTensor rules.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from mindspeed_ops.backends import has_module, needs_grad, resolve_impl, warn_once
from mindspeed_ops.gated_delta_chunk import chunked_gated_delta_rule
from mindspeed_ops.validate import check_cu_seqlens, check_float, check_same_device

L2NORM_EPS = 1e-6  # flash-linear-attention's and transformers' l2norm epsilon


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    """Batched inputs -> (batch, heads_v, seq, ...) in the compute dtype, q and k normalised,
    q scaled, key heads repeated over their value heads."""
    acc = torch.promote_types(q.dtype, torch.float32)
    group = v.shape[2] // k.shape[2]
    q, k = (t.to(acc).transpose(1, 2) for t in (q, k))  # (batch, heads_k, seq, dk)
    if use_qk_l2norm:  # before repeating: each key head is normalised once
        q, k = _l2norm(q), _l2norm(k)
    if group > 1:
        q, k = (t.repeat_interleave(group, dim=1) for t in (q, k))
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    v = v.to(acc).transpose(1, 2)  # (batch, heads_v, seq, dv)
    g, beta = (t.to(acc).transpose(1, 2) for t in (g, beta))  # (batch, heads_v, seq)
    return q, k, v, g, beta


def _token_update(state, q_t, k_t, v_t, g_t, beta_t):
    """One token of the recurrence on prepared (batch, heads, dim) rows -> (o_t, state)."""
    state = state * g_t.exp()[..., None, None]
    predicted = (k_t.unsqueeze(-2) @ state).squeeze(-2)  # S^T k: what the state recalls for k
    delta = beta_t[..., None] * (v_t - predicted)
    state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
    return (q_t.unsqueeze(-2) @ state).squeeze(-2), state


def _recurrence(q, k, v, g, beta, state):
    """Prepared (batch, heads, seq, ...) tensors, token by token -> (o, final state)."""
    outs = []
    # unbind, not q[:, :, t]: the backward of each index would build a whole zero gradient
    # per token (quadratic in seq); unbind's stacks the token gradients once.
    tokens = zip(*(t.unbind(2) for t in (q, k, v, g, beta)), strict=True)
    for q_t, k_t, v_t, g_t, beta_t in tokens:
        o_t, state = _token_update(state, q_t, k_t, v_t, g_t, beta_t)
        outs.append(o_t)
    out = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return out, state


def _zero_state(q, k, v, rows):
    acc = torch.promote_types(q.dtype, torch.float32)
    return torch.zeros(rows, v.shape[-2], k.shape[-1], v.shape[-1], dtype=acc, device=q.device)


def gated_delta_rule_reference(
    q, k, v, g, beta, *, initial_state=None, output_final_state=False, cu_seqlens=None,
    scale=None, use_qk_l2norm=True,
):  # fmt: skip
    """The oracle: the recurrence one token at a time -> (o, final state or None); autograd
    all the way. Same arguments as `gated_delta_rule`."""
    packed = cu_seqlens is not None
    if packed:  # one row holding every document
        q, k, v, g, beta = (t.unsqueeze(0) for t in (q, k, v, g, beta))
    rows = cu_seqlens.numel() - 1 if packed else q.shape[0]
    state0 = _zero_state(q, k, v, rows) if initial_state is None else (
        initial_state.to(torch.promote_types(q.dtype, torch.float32))
    )
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    if not packed:
        out, final = _recurrence(q, k, v, g, beta, state0)
    else:
        pieces, finals = [], []
        bounds = cu_seqlens.tolist()
        for doc, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            piece = [t[:, :, a:b] for t in (q, k, v, g, beta)]
            o_doc, s_doc = _recurrence(*piece, state0[doc : doc + 1])
            pieces.append(o_doc)
            finals.append(s_doc)
        out = torch.cat(pieces, dim=2) if pieces else v.new_zeros(v.shape)
        final = torch.cat(finals) if finals else state0
    out = out.transpose(1, 2).to(out_dtype)
    if packed:
        out = out.squeeze(0)
    return out, (final if output_final_state else None)


def _validate(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, state_name="initial_state"):
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_float(name, t)
        check_same_device(name, t, q)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}")
    packed = cu_seqlens is not None
    layout = "(tokens, heads, dim) with cu_seqlens" if packed else "(batch, seq, heads, dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != (3 if packed else 4):
            raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k shape {tuple(k.shape)} must equal q shape {tuple(q.shape)}")
    if v.shape[:-2] != q.shape[:-2]:
        raise ValueError(f"v shape {tuple(v.shape)} and q shape {tuple(q.shape)} must agree "
                         "on the leading (batch, seq) dims")  # fmt: skip
    if v.shape[-2] % q.shape[-2]:
        raise ValueError(f"v's {v.shape[-2]} heads are not a multiple of q's {q.shape[-2]}")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != v.shape[:-1]:
            raise ValueError(f"{name} must have shape {tuple(v.shape[:-1])} (v's without "
                             f"head_dim), got {tuple(t.shape)}")  # fmt: skip
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if packed:
        check_same_device("cu_seqlens", cu_seqlens, q)
        check_cu_seqlens(cu_seqlens, q.shape[0])
    if initial_state is not None:
        check_float(state_name, initial_state)
        check_same_device(state_name, initial_state, q)
        rows = cu_seqlens.numel() - 1 if packed else q.shape[0]
        want = (rows, v.shape[-2], q.shape[-1], v.shape[-1])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"{state_name} must have shape {want} (num_seqs, heads_v, dk, "
                             f"dv), got {tuple(initial_state.shape)}")  # fmt: skip


def _fla_backward_ok(t: Tensor) -> bool:
    """fla 0.6 raises in its gated backward on Hopper with Triton >= 3.4, < 3.7.1 (its issue
    #640: wrong results) unless tilelang is installed; seen on an H200 with Triton 3.6."""
    if torch.cuda.get_device_capability(t.device)[0] != 9 or has_module("tilelang"):
        return True
    import triton

    version = tuple(int(p) for p in re.findall(r"\d+", triton.__version__)[:3])
    return not (3, 4) <= version < (3, 7, 1)


def _fla(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, scale, use_qk_l2norm):
    """flash-linear-attention's Triton kernels (batched layout; a packed row is batch 1)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    group = v.shape[-2] // q.shape[-2]
    if group > 1:  # not every fla release takes fewer key heads than value heads
        q, k = (t.repeat_interleave(group, dim=-2) for t in (q, k))
    packed = cu_seqlens is not None
    if packed:
        q, k, v, g, beta = (t.unsqueeze(0) for t in (q, k, v, g, beta))
    out, final = chunk_gated_delta_rule(
        q, k, v, g.float(), beta.to(q.dtype), scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
    )  # fmt: skip
    return (out.squeeze(0) if packed else out), final


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    impl: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Gated DeltaNet's linear attention over whole sequences -> (o, final state or None).

    Args:
        q, k: (batch, seq, heads_k, dk), or (tokens, heads_k, dk) with `cu_seqlens`.
        v: (batch, seq, heads_v, dv) or (tokens, heads_v, dv); same dtype as q.
        g: log decay per token and value head, (batch, seq, heads_v) or (tokens, heads_v).
        beta: write strength, same shape as g (a sigmoid output in Qwen3-Next).
        initial_state: (num_seqs, heads_v, dk, dv) state each sequence starts from; None: 0.
        output_final_state: also return each sequence's state after its last token.
        cu_seqlens: packed document boundaries, int32/int64, ending at the token count.
        scale: q's scale after normalisation; None: dk^-0.5.
        use_qk_l2norm: L2-normalise q and k per head first (Qwen3-Next does).
        chunk_size: tokens per chunk of the chunked algorithm.
        impl: "auto", "reference", "cpu", "cuda" or "npu".
    """
    _validate(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size)
    backend = resolve_impl(impl, q)
    options = dict(initial_state=initial_state, output_final_state=output_final_state,
                   cu_seqlens=cu_seqlens, scale=scale, use_qk_l2norm=use_qk_l2norm)  # fmt: skip
    if backend == "reference":
        return gated_delta_rule_reference(q, k, v, g, beta, **options)
    if backend == "cuda":
        if has_module("fla"):
            if not needs_grad(q, k, v, g, beta, initial_state) or _fla_backward_ok(q):
                return _fla(q, k, v, g, beta, **options)
            warn_once("gated_delta_rule_fla_bwd", "gated_delta_rule: fla's backward refuses this "
                      "GPU with this Triton version (Hopper, Triton < 3.7.1); training runs the "
                      "chunked PyTorch algorithm")  # fmt: skip
        elif impl == "cuda":
            warn_once("gated_delta_rule_cuda", "gated_delta_rule: flash-linear-attention (fla) "
                      "not installed, impl='cuda' runs the chunked PyTorch algorithm")  # fmt: skip
    packed = cu_seqlens is not None
    if packed:
        q, k, v, g, beta = (t.unsqueeze(0) for t in (q, k, v, g, beta))
    out_dtype = q.dtype
    prepared = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    state0 = None if initial_state is None else initial_state.to(prepared[0].dtype)
    bounds = cu_seqlens.tolist() if packed else None
    out, final = chunked_gated_delta_rule(*prepared, state0, bounds, chunk_size)
    out = out.transpose(1, 2).to(out_dtype)
    return (out.squeeze(0) if packed else out), (final if output_final_state else None)


def gated_delta_rule_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[Tensor, Tensor]:
    """One decoding step of the recurrence for a batch of sequences -> (o, new state).

    Args:
        q, k: (batch, heads_k, dk), one token per sequence.
        v: (batch, heads_v, dv).
        g, beta: (batch, heads_v).
        state: (batch, heads_v, dk, dv) after the previous token (fp32); None: zeros.
        scale, use_qk_l2norm: as in `gated_delta_rule`.

    Returns o (batch, heads_v, dv) in q's dtype and the new state (the input is not modified).
    """
    rows = [t.unsqueeze(1) for t in (q, k, v, g, beta)]  # a sequence of one token
    _validate(*rows, state, None, 1, state_name="state")
    if state is None:
        state = _zero_state(q, k, v, q.shape[0])
    q1, k1, v1, g1, beta1 = _prepare(*rows, scale, use_qk_l2norm)
    state = state.to(q1.dtype)
    o, state = _token_update(state, q1[:, :, 0], k1[:, :, 0], v1[:, :, 0], g1[:, :, 0],
                             beta1[:, :, 0])  # fmt: skip
    return o.to(q.dtype), state
