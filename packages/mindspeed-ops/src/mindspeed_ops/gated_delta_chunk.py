"""The chunked gated delta rule in PyTorch: the CPU backend and every device's fallback.

Within a chunk of C tokens that starts from state S0, write gamma_t for the sum of g over the
chunk's tokens up to t. Unrolling S_t = e^{g_t} S_{t-1} + k_t u_t^T, with the delta-rule update
u_t = beta_t (v_t - e^{g_t} S_{t-1}^T k_t), gives

    S_t = e^{gamma_t} S0 + sum_{s<=t} e^{gamma_t - gamma_s} k_s u_s^T,

so the C updates u solve one unit lower-triangular system (the UT transform of the WY
representation):

    (I + A) U = diag(beta) V - diag(beta e^{gamma}) K S0,   A_ts = beta_t e^{gamma_t - gamma_s} k_t.k_s (s < t).

With T = (I + A)^{-1}, U = T diag(beta) V - [T diag(beta e^{gamma}) K] S0: both T-products are
independent of the state, so every chunk's are computed at once; only the short loop over
chunks (two small matmuls each) carries the state. Outputs and the next state follow from U:

    o_t = e^{gamma_t} S0^T q_t + sum_{s<=t} e^{gamma_t - gamma_s} (q_t.k_s) u_s
    S_C = e^{gamma_C} S0 + sum_s e^{gamma_C - gamma_s} k_s u_s^T.

Only differences gamma_t - gamma_s with s <= t (and gamma_t itself) are exponentiated, so no
factor e^{-gamma} appears and strong decay cannot overflow. Documents are padded at their end
to whole chunks with zero k, v, g and beta, which leave the state unchanged; the state is
reset at each document's first chunk. Plain torch ops throughout: autograd differentiates it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _layout(length: int, bounds: list[int] | None, chunk: int):
    """Where each token goes in the chunk-padded sequence, and where documents start and end.

    Returns (index or None, padded length, starts {chunk: document}, ends {document: chunk},
    empty documents). Batched rows (bounds None) are one document each and only pad at the end.
    """
    if bounds is None:
        num_chunks = -(-length // chunk)
        empty = [None] if num_chunks == 0 else []  # `None`: all rows at once
        return None, num_chunks * chunk, {0: None}, {None: num_chunks - 1}, empty
    index, starts, ends, empty, at = [], {}, {}, [], 0
    for doc, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if b == a:
            empty.append(doc)
            continue
        num_chunks = -(-(b - a) // chunk)
        starts[at // chunk] = doc
        ends[doc] = at // chunk + num_chunks - 1
        index.extend(range(a, b))
        index.extend([length] * (num_chunks * chunk - (b - a)))  # the appended zero token
        at += num_chunks * chunk
    return index, at, starts, ends, empty


def _scatter(x: Tensor, index: list[int] | None, padded: int) -> Tensor:
    """(B, H, T, ...) -> (B, H, padded, ...): documents laid out on whole chunks, zero padding."""
    if index is None:
        pad = [0, 0] * (x.dim() - 3) + [0, padded - x.shape[2]]
        return F.pad(x, pad)
    zero = x.new_zeros(*x.shape[:2], 1, *x.shape[3:])
    ext = torch.cat([x, zero], dim=2)
    return ext.index_select(2, torch.tensor(index, device=x.device))


def _intra_chunk(q, k, v, g, beta):
    """Everything that does not need the carried state, for all chunks at once.

    q, k (B, H, N, C, Dk), v (B, H, N, C, Dv), g, beta (B, H, N, C) ->
    u0 = T beta V, w = T beta e^gamma K, attn (q_t.k_s e^{gamma_t-gamma_s}, s <= t),
    q e^gamma, k e^{gamma_C - gamma}, e^{gamma_C}.
    """
    chunk = q.shape[-2]
    gamma = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # (..., t, s): e^{gamma_t - gamma_s} on and below the diagonal, 0 above (masked before exp).
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)  # A; the unit diagonal is implied
    rhs = torch.cat([v * beta[..., None], k_beta * gamma.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u0, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    attn = q @ k.transpose(-1, -2) * decay
    q_decayed = q * gamma.exp()[..., None]
    k_decayed = k * (gamma[..., -1:] - gamma).exp()[..., None]
    return u0, w, attn, q_decayed, k_decayed, gamma[..., -1].exp()


def chunked_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    bounds: list[int] | None,
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """q, k (B, H, T, Dk) normalised and scaled, v (B, H, T, Dv), g, beta (B, H, T), all in the
    compute dtype; `bounds` the document boundaries of a packed row (then B == 1) or None;
    initial_state (num_seqs, H, Dk, Dv) or None -> (o (B, H, T, Dv), final (num_seqs, H, Dk, Dv)).
    """
    batch, heads, length, dim_k = q.shape
    dim_v = v.shape[-1]
    index, padded, starts, ends, empty = _layout(length, bounds, chunk_size)
    num_seqs = batch if bounds is None else len(bounds) - 1
    state_shape = (num_seqs if bounds is None else 1, heads, dim_k, dim_v)

    def start_state(doc):
        if initial_state is None:
            return q.new_zeros(state_shape)
        return initial_state if doc is None else initial_state[doc : doc + 1]

    finals: dict = {doc: start_state(doc) for doc in empty}
    outputs = q.new_zeros(batch, heads, 0, dim_v)
    if padded:
        num_chunks = padded // chunk_size
        chunked = [
            _scatter(t, index, padded).unflatten(2, (num_chunks, chunk_size))
            for t in (q, k, v, g, beta)
        ]
        u0, w, attn, q_decayed, k_decayed, chunk_decay = _intra_chunk(*chunked)
        updates, states_before, state = [], [], None
        last_of = {c: doc for doc, c in ends.items()}
        for c in range(num_chunks):
            if c in starts:
                state = start_state(starts[c])
            states_before.append(state)
            u = u0[:, :, c] - w[:, :, c] @ state
            updates.append(u)
            state = state * chunk_decay[:, :, c, None, None] + k_decayed[:, :, c].mT @ u
            if c in last_of:
                finals[last_of[c]] = state
        u_all = torch.stack(updates, dim=2)  # (B, H, N, C, Dv)
        prior = torch.stack(states_before, dim=2)  # (B, H, N, Dk, Dv)
        out = (q_decayed @ prior + attn @ u_all).flatten(2, 3)
        if index is None:
            outputs = out[:, :, :length]
        else:
            real = [i for i, j in enumerate(index) if j < length]  # index is ascending
            outputs = out.index_select(2, torch.tensor(real, device=q.device))
    if bounds is None:
        final = finals[None]
    else:
        final = torch.cat([finals[doc] for doc in range(num_seqs)]) if num_seqs else None
    return outputs, final
