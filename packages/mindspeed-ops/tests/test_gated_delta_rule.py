"""The gated delta rule: the chunked algorithm against our token loop, our token loop against
transformers' Qwen3-Next functions (code we did not write), packed documents, decoding steps,
the causal conv1d helper and the input checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mindspeed_ops as mo
from mindspeed_ops.backends import cuda_available

HEADS_K, HEADS_V, DIM_K, DIM_V = 2, 4, 16, 8  # two value heads per key head, as Qwen3-Next


def _inputs(seq, batch=1, packed=False, states=None, seed=0, g_max=0.0):
    """fp32 CPU inputs in the model's ranges: beta a sigmoid, g = -softplus-like log decay."""
    gen = torch.Generator().manual_seed(seed)
    lead = (seq,) if packed else (batch, seq)
    out = {
        "q": torch.randn(*lead, HEADS_K, DIM_K, generator=gen),
        "k": torch.randn(*lead, HEADS_K, DIM_K, generator=gen),
        "v": torch.randn(*lead, HEADS_V, DIM_V, generator=gen),
        "g": -torch.rand(*lead, HEADS_V, generator=gen) * 2 + g_max,
        "beta": torch.rand(*lead, HEADS_V, generator=gen),
    }
    if states:
        out["initial_state"] = torch.randn(states, HEADS_V, DIM_K, DIM_V, generator=gen)
    return out


def _chunked(**kwargs):
    return lambda **t: mo.gated_delta_rule(**t, **kwargs, output_final_state=True, impl="cpu")


def _reference(**kwargs):
    return lambda **t: mo.gated_delta_rule_reference(**t, **kwargs, output_final_state=True)


@pytest.mark.parametrize("seq", [1, 37, 130])
@pytest.mark.parametrize(
    "precision, tol", [(torch.float64, (1e-9, 1e-9)), (torch.float32, (1e-5, 1e-5))],
    ids=["fp64", "fp32"],
)  # fmt: skip  ("dtype" is conftest's fp32/bf16 parametrisation)
def test_chunked_equals_the_recurrence(parity, seq, precision, tol):
    # o, the final state and the gradients of q, k, v, g, beta and the initial state; lengths
    # off the chunk grid of 64 (1, 37, 130 = 2 x 64 + 2).
    inputs = _inputs(seq, batch=2, states=2)
    parity(_chunked(), _reference(), inputs, precision, tol=tol)


@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "raw"])
def test_small_chunks_and_no_l2norm_equal_the_recurrence(parity, l2norm):
    inputs = _inputs(45, batch=1, states=1)
    inputs["k"] = torch.nn.functional.normalize(inputs["k"], dim=-1)  # a stable raw delta rule
    parity(_chunked(chunk_size=8, use_qk_l2norm=l2norm, scale=0.3),
           _reference(use_qk_l2norm=l2norm, scale=0.3), inputs, torch.float64,
           tol=(1e-9, 1e-9))  # fmt: skip


def test_positive_log_decay_is_allowed_and_exact(parity):
    # g > 0 is not refused (no value checks): the chunked form then still equals the loop.
    parity(_chunked(), _reference(), _inputs(70, g_max=1.0, states=1), torch.float64,
           tol=(1e-9, 1e-9))  # fmt: skip


@pytest.mark.parametrize("oracle", ["torch_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule"])
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "raw"])
def test_equals_transformers_qwen3_next(oracle, l2norm):
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    t = _inputs(100, batch=2, states=2, seed=1)
    if not l2norm:
        t["q"], t["k"] = (F.normalize(x, dim=-1) for x in (t["q"], t["k"]))
    # Key heads repeated over their value heads here: transformers before ~5.20 takes equal
    # head counts only (the layer repeated them); our op repeats them itself.
    q, k = (x.repeat_interleave(HEADS_V // HEADS_K, dim=2) for x in (t["q"], t["k"]))
    want_o, want_s = getattr(hf, oracle)(
        q, k, t["v"], t["g"], t["beta"], initial_state=t["initial_state"],
        output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
    )  # fmt: skip
    for impl in ("reference", "cpu"):
        o, s = mo.gated_delta_rule(**t, output_final_state=True, use_qk_l2norm=l2norm, impl=impl)
        torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s, want_s, atol=1e-5, rtol=1e-5)


BOUNDS = [0, 5, 5, 70, 71, 200]  # an empty document, a one-token one, one crossing chunks


def test_packed_documents_equal_each_document_alone():
    t = _inputs(BOUNDS[-1], packed=True, states=len(BOUNDS) - 1)
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    o, s = mo.gated_delta_rule(**t, cu_seqlens=cu, output_final_state=True, impl="cpu")
    assert o.shape == (BOUNDS[-1], HEADS_V, DIM_V) and s.shape == (len(BOUNDS) - 1, HEADS_V,
                                                                    DIM_K, DIM_V)  # fmt: skip
    for doc, (a, b) in enumerate(zip(BOUNDS[:-1], BOUNDS[1:], strict=True)):
        alone = {n: x[a:b].unsqueeze(0) for n, x in t.items() if n != "initial_state"}
        o_doc, s_doc = mo.gated_delta_rule(**alone, initial_state=t["initial_state"][doc : doc + 1],
                                           output_final_state=True, impl="cpu")  # fmt: skip
        torch.testing.assert_close(o[a:b], o_doc[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(s[doc], s_doc[0], atol=1e-6, rtol=1e-6)
    assert torch.equal(s[1], t["initial_state"][1])  # the empty document keeps its state


def test_packed_gradients_equal_the_recurrence(parity):
    cu = torch.tensor(BOUNDS)
    inputs = _inputs(BOUNDS[-1], packed=True, states=len(BOUNDS) - 1)
    parity(_chunked(cu_seqlens=cu), _reference(cu_seqlens=cu), inputs, torch.float64,
           tol=(1e-9, 1e-9))  # fmt: skip


def test_decoding_steps_continue_the_chunked_forward():
    # Prefill 37 tokens chunked, then decode 30 single steps from its state: the outputs and
    # the final state equal one chunked pass over all 67; and 30 steps from zero state equal
    # the chunked pass over those 30 tokens.
    t = _inputs(67, batch=3, seed=2)
    o_all, s_all = mo.gated_delta_rule(**t, output_final_state=True, impl="cpu")
    prefill = {n: x[:, :37] for n, x in t.items()}
    _, state = mo.gated_delta_rule(**prefill, output_final_state=True, impl="cpu")
    zero_state, zero_outs = None, []
    for i in range(37, 67):
        step = {n: x[:, i] for n, x in t.items()}
        o_i, state = mo.gated_delta_rule_step(**step, state=state)
        torch.testing.assert_close(o_i, o_all[:, i], atol=1e-5, rtol=1e-5)
        o_zero, zero_state = mo.gated_delta_rule_step(**step, state=zero_state)
        zero_outs.append(o_zero)
    torch.testing.assert_close(state, s_all, atol=1e-5, rtol=1e-5)
    o_tail, s_tail = mo.gated_delta_rule(**{n: x[:, 37:] for n, x in t.items()},
                                         output_final_state=True, impl="cpu")  # fmt: skip
    torch.testing.assert_close(torch.stack(zero_outs, 1), o_tail, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(zero_state, s_tail, atol=1e-5, rtol=1e-5)


def test_bf16_inputs_give_bf16_outputs_and_an_fp32_state():
    t = _inputs(80, batch=1, states=1)
    o32, s32 = mo.gated_delta_rule(**t, output_final_state=True)
    low = {n: (x if n == "initial_state" else x.bfloat16()) for n, x in t.items()}
    o16, s16 = mo.gated_delta_rule(**low, output_final_state=True)
    assert o16.dtype == torch.bfloat16 and s16.dtype == torch.float32
    torch.testing.assert_close(o16.float(), o32, atol=5e-2, rtol=5e-2)
    assert mo.gated_delta_rule(**low)[1] is None  # no state unless asked


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="no GPU")
def test_cuda_backend_equals_the_reference(parity):
    # Forward without gradients: fla's kernels when installed, else the chunked algorithm on
    # the GPU. With gradients: fla where its backward runs, else the chunked algorithm.
    cu = torch.tensor(BOUNDS, device="cuda")
    inputs = _inputs(BOUNDS[-1], packed=True, states=len(BOUNDS) - 1)
    t = {n: x.cuda() for n, x in inputs.items()}
    with torch.no_grad():
        o, s = mo.gated_delta_rule(**t, cu_seqlens=cu, output_final_state=True, impl="cuda")
    want_o, want_s = mo.gated_delta_rule_reference(**t, cu_seqlens=cu, output_final_state=True)
    torch.testing.assert_close(o, want_o, atol=2e-3, rtol=2e-3)  # fla's matmuls are tf32
    torch.testing.assert_close(s, want_s, atol=2e-3, rtol=2e-3)

    def ours(**x):
        return mo.gated_delta_rule(**x, cu_seqlens=cu, output_final_state=True, impl="cuda")

    parity(ours, _reference(cu_seqlens=cu), inputs, torch.float32, device="cuda", tol=(2e-3, 2e-3))


# -- the causal conv1d helper ---------------------------------------------------------------


def _conv_inputs(seq=20, channels=6, kernel=4, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2, seq, channels, generator=gen),
            torch.randn(channels, kernel, generator=gen), torch.randn(channels, generator=gen))  # fmt: skip


def test_causal_conv1d_equals_transformers_and_continues_from_its_cache():
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    x, w, b = _conv_inputs()
    y, cache = mo.causal_conv1d(x, w, b)
    want = hf.causal_conv1d_fn(x.transpose(1, 2), w, b, activation="silu").transpose(1, 2)
    torch.testing.assert_close(y, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cache, x[:, -3:])
    # a prefix, then one token at a time from the cache: the same outputs
    y0, cache = mo.causal_conv1d(x[:, :7], w, b)
    pieces = [y0]
    for i in range(7, x.shape[1]):
        y_i, cache = mo.causal_conv1d(x[:, i : i + 1], w, b, cache=cache)
        pieces.append(y_i)
    torch.testing.assert_close(torch.cat(pieces, 1), y, atol=1e-6, rtol=1e-6)
    y_lin, _ = mo.causal_conv1d(x, w, None, activation=None)
    torch.testing.assert_close(F.silu(y_lin + b), y, atol=1e-6, rtol=1e-6)


# -- bad input -----------------------------------------------------------------------------


def _call(**changes):
    t = _inputs(10, batch=2)
    t.update(changes)
    return lambda: mo.gated_delta_rule(**t)


_T = _inputs(10, batch=2)
_X, _W, _B = _conv_inputs()


@pytest.mark.parametrize(
    "call, error, match",
    [
        (_call(k=_T["k"][:, :9]), ValueError, r"k shape \(2, 9, 2, 16\) must equal q shape"),
        (_call(v=_T["v"][:, :, :3]), ValueError, "v's 3 heads are not a multiple of q's 2"),
        (_call(v=_T["v"][:1]), ValueError, "v shape .* must agree on the leading"),
        (_call(g=_T["g"][..., :2]), ValueError, r"g must have shape \(2, 10, 4\)"),
        (_call(beta=_T["beta"][:, :5]), ValueError, "beta must have shape"),
        (_call(q=_T["q"][0]), ValueError, r"q must be \(batch, seq, heads, dim\)"),
        (_call(v=_T["v"].double()), TypeError, "v has dtype torch.float64 but q has"),
        (_call(g=_T["g"].long()), TypeError, "g must be a floating point tensor"),
        (_call(initial_state=torch.zeros(2, 4, 16, 9)), ValueError, r"initial_state must have shape \(2, 4, 16, 8\)"),
        (_call(chunk_size=0), ValueError, "chunk_size must be a positive int"),
        (_call(impl="triton"), ValueError, "impl='triton' is not one of"),
        (lambda: mo.gated_delta_rule(*(_T[n][0] for n in ("q", "k", "v", "g", "beta")),
                                     cu_seqlens=torch.tensor([0.0, 10.0])), TypeError,
         "cu_seqlens must be an int32 or int64 tensor"),
        (lambda: mo.gated_delta_rule(*(_T[n][0] for n in ("q", "k", "v", "g", "beta")),
                                     cu_seqlens=torch.tensor([0, 4, 9])), ValueError,
         "cu_seqlens ends at 9 but the packed input has 10 tokens"),
        (lambda: mo.gated_delta_rule(*(_T[n] for n in ("q", "k", "v", "g", "beta")),
                                     cu_seqlens=torch.tensor([0, 10])), ValueError,
         r"q must be \(tokens, heads, dim\) with cu_seqlens"),
        (lambda: mo.gated_delta_rule_step(*(_T[n][:, 0] for n in ("q", "k", "v", "g", "beta")),
                                          state=torch.zeros(2, 4, 8, 16)), ValueError,
         r"^state must have shape \(2, 4, 16, 8\)"),
        (lambda: mo.causal_conv1d(_X, _W[:3]), ValueError, r"weight must be \(channels=6, kernel\)"),
        (lambda: mo.causal_conv1d(_X, _W, cache=torch.zeros(2, 4, 6)), ValueError,
         r"cache must be \(batch, kernel - 1, channels\) = \(2, 3, 6\)"),
        (lambda: mo.causal_conv1d(_X, _W, activation="gelu"), ValueError, "activation must be one of"),
    ],
    ids=["k-shape", "heads", "batch", "g-shape", "beta-shape", "q-dims", "v-dtype", "g-int",
         "state-shape", "chunk", "impl", "cu-dtype", "cu-total", "cu-batched", "step-state",
         "conv-weight", "conv-cache", "conv-activation"],
)  # fmt: skip
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.slow
def test_batched_op_compiles_in_one_graph():
    # torch.compile(fullgraph=True) of the batched chunked path (~25 s on 2 cores): outputs,
    # final state and gradients equal eager. Packed documents read their boundaries as ints,
    # a graph break by design (as context parallel's attention ring does).
    t = _inputs(70, batch=2, states=2)

    def run(fn):
        leaves = {n: x.clone().requires_grad_() for n, x in t.items()}
        o, s = fn(**leaves)
        (o.sum() + s.square().sum()).backward()
        return [o.detach(), s.detach()] + [x.grad for x in leaves.values()]

    def op(**x):
        return mo.gated_delta_rule(**x, output_final_state=True, impl="cpu")

    for got, want in zip(run(torch.compile(op, fullgraph=True)), run(op), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
