"""The attention kernels one by one against the reference in fp64: out, lse, dq, dk, dv (with a
gradient through lse too), on packed documents of random lengths (1 included, longer than the
window), GQA, windows, soft caps, latent-attention head sizes and ring-chunk offsets; bf16 no
worse than the reference's own bf16 error; O(tokens) memory; the ring's backward from merged
statistics."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import mindspeed_ops as mo
from mindspeed_ops import attention_dispatch as dispatch
from mindspeed_ops import attention_kernels as kernels
from mindspeed_ops import cpu_ext

NO_WINDOW = kernels.NO_WINDOW

# (name, doc lengths, heads_q, heads_kv, d, d_v, causal, window, softcap, offsets)
CASES = [
    ("gqa_docs", [1, 37, 300, 5], 8, 2, 64, 64, True, NO_WINDOW, 0.0, None),
    ("window", [290, 1, 60], 4, 2, 32, 32, True, 48, 0.0, None),
    ("softcap_window", [200, 77], 4, 1, 16, 16, True, 31, 20.0, None),
    ("latent_heads", [150, 90], 4, 4, 48, 32, True, NO_WINDOW, 0.0, None),
    ("bidirectional_window", [120, 33], 2, 2, 16, 16, False, 9, 5.0, None),
    ("ring_offsets", [64, 130], 4, 2, 16, 16, True, 50, 0.0, [64, 130]),
]
APPLIES = {  # which cases each CPU kernel takes (choose() never gives it the others)
    "cpu_flash": {c[0] for c in CASES},
    "composed": {c[0] for c in CASES},
    "torch_flash": {"gqa_docs"},
}


def _inputs(lengths, hq, hkv, d, dv, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    q, k = (torch.randn(tokens, h, d, generator=gen) for h in (hq, hkv))
    v = torch.randn(tokens, hkv, dv, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return [t.to(dtype) for t in (q, k, v)], cu


def _reference_grads(q, k, v, cu, causal, window, softcap, offsets, dout, dlse):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    offsets = None if offsets is None else torch.tensor(offsets)
    out, lse = mo.attention_reference(
        *leaves, causal=causal, window=None if window == NO_WINDOW else window, cu_seqlens=cu,
        softcap=softcap or None, offsets=offsets,
    )  # fmt: skip
    finite = torch.isfinite(lse)
    loss = (out * dout.double()).sum() + (lse.where(finite, 0) * dlse.double()).sum()
    return out, lse, torch.autograd.grad(loss, leaves)


def _kernel_run(kernel, q, k, v, cu, causal, window, softcap, offsets, dout, dlse):
    scale = 1 / math.sqrt(q.shape[-1])
    offs = None if offsets is None else torch.tensor(offsets)
    out, lse = kernels.forward(kernel, q, k, v, cu, cu, offs, causal, window, softcap, scale)
    grads = kernels.backward(kernel, dout.to(q.dtype), dlse, q, k, v, out, lse, cu, cu, offs,
                             causal, window, softcap, scale)  # fmt: skip
    return out, lse, grads


@pytest.mark.parametrize("kernel", ["cpu_flash", "torch_flash", "composed"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_equals_the_reference_fp32(kernel, case):
    name, lengths, hq, hkv, d, dv, causal, window, softcap, offsets = case
    if name not in APPLIES[kernel]:
        pytest.skip(f"{kernel} does not take {name}")
    if kernel == "cpu_flash" and cpu_ext.load() is None:
        pytest.skip("no C++ kernels here")
    (q, k, v), cu = _inputs(lengths, hq, hkv, d, dv, torch.float32)
    gen = torch.Generator().manual_seed(1)
    dout = torch.randn(q.shape[0], hq, dv, generator=gen)
    dlse = torch.randn(hq, q.shape[0], generator=gen)
    want = _reference_grads(q, k, v, cu, causal, window, softcap, offsets, dout, dlse)
    got = _kernel_run(kernel, q, k, v, cu, causal, window, softcap, offsets, dout, dlse)
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0].double(), want[0], **tol)
    torch.testing.assert_close(got[1].double(), want[1].double(), **tol)
    for g, w, n in zip(got[2], want[2], "qkv", strict=True):
        torch.testing.assert_close(g.double(), w, **tol, msg=lambda m, n=n: f"d{n}: {m}")


@pytest.mark.parametrize("case", CASES[:4], ids=[c[0] for c in CASES[:4]])
def test_bf16_error_is_that_of_a_fused_kernel(case):
    # Truth: fp64 math on the bf16-rounded inputs. Like every flash kernel (torch's CPU flash,
    # FlashAttention-2) ours takes the backward's row term <dout, out> from the saved bf16
    # output, so its bf16 gradients may be a little further from the truth than the reference's
    # (fp32 throughout): within 2x the reference's error, and no worse than torch's own fused
    # CPU kernel where that kernel applies (measured: 1.0-1.6x vs torch's 1.5-4x).
    if cpu_ext.load() is None:
        pytest.skip("no C++ kernels here")
    name, lengths, hq, hkv, d, dv, causal, window, softcap, offsets = case
    (q, k, v), cu = _inputs(lengths, hq, hkv, d, dv, torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    dout = torch.randn(q.shape[0], hq, dv, generator=gen).bfloat16()
    truth = _reference_grads(q, k, v, cu, causal, window, softcap, offsets, dout,
                             torch.zeros(hq, q.shape[0]))  # fmt: skip
    exact = [truth[0], *truth[2]]
    ours = _kernel_run("cpu_flash", q, k, v, cu, causal, window, softcap, offsets, dout, None)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref_out = mo.attention_reference(
        *leaves, causal=causal, window=None if window == NO_WINDOW else window, cu_seqlens=cu,
        softcap=softcap or None,
    )[0]  # fmt: skip
    ref = [ref_out, *torch.autograd.grad((ref_out.float() * dout.float()).sum(), leaves)]
    fused = None
    if name in APPLIES["torch_flash"]:
        run = _kernel_run("torch_flash", q, k, v, cu, causal, window, softcap, offsets, dout, None)
        fused = [run[0], *run[2]]
    for i, what in enumerate(["out", "dq", "dk", "dv"]):
        err = (ours[0] if i == 0 else ours[2][i - 1]).double().sub(exact[i]).abs().max().item()
        err_ref = ref[i].double().sub(exact[i]).abs().max().item()
        assert err <= 2.0 * err_ref + 1e-6, (name, what, err, err_ref)
        if fused is not None:
            err_fused = fused[i].double().sub(exact[i]).abs().max().item()
            assert err <= err_fused + 1e-6, (name, what, err, err_fused)


def test_ring_blocks_backward_from_merged_statistics():
    # Keys in two halves (as the ring visits them): merge the partial results by their lse,
    # then each block's attention_backward with the merged out and lse adds up to the gradient
    # of attention over all keys, for queries that see both halves (offset: after them).
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(16, 4, 8, generator=gen)
    k, v = (torch.randn(32, 2, 8, generator=gen) for _ in range(2))
    cu, offsets = torch.tensor([0, 16]), torch.tensor([16])
    halves = [slice(0, 16), slice(16, 32)]
    parts = [
        mo.attention(q, k[h], v[h], cu_seqlens=cu, causal=i == 1, window=20, offsets=offsets
                     if i == 0 else None, return_lse=True)
        for i, h in enumerate(halves)
    ]  # fmt: skip
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(o * torch.exp(s - lse).T[..., None] for o, s in parts)
    dout = torch.randn(out.shape, generator=gen)
    grads = [
        mo.attention_backward(dout, q, k[h], v[h], out, lse, cu_seqlens=cu, causal=i == 1,
                              window=20, offsets=offsets if i == 0 else None)
        for i, h in enumerate(halves)
    ]  # fmt: skip
    # The whole: queries at positions 16..31 of a 32-token document, window 20.
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    full_q = torch.cat([torch.zeros(16, 4, 8), leaves[0]])
    whole = mo.attention_reference(full_q, leaves[1], leaves[2], cu_seqlens=torch.tensor([0, 32]),
                                   window=20)[0][16:]  # fmt: skip
    torch.testing.assert_close(out, whole.detach(), atol=1e-5, rtol=1e-5)
    want = torch.autograd.grad((whole * dout).sum(), leaves)
    torch.testing.assert_close(grads[0][0] + grads[1][0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([grads[0][1], grads[1][1]]), want[1], atol=1e-5,
                               rtol=1e-5)  # fmt: skip
    torch.testing.assert_close(torch.cat([grads[0][2], grads[1][2]]), want[2], atol=1e-5,
                               rtol=1e-5)  # fmt: skip


MEMORY_PROBE = """
import resource, torch, mindspeed_ops as mo
torch.set_num_threads(1)
s = {s}
q, k, v = (torch.randn(s, 1, 8, requires_grad=True) for _ in range(3))
cu = torch.tensor([0, s])
mo.attention(q[:64], k[:64], v[:64], cu_seqlens=torch.tensor([0, 64]), window={w})  # warm up
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = mo.attention(q, k, v, cu_seqlens=cu, window={w}, softcap=30.0)
out.sum().backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB")
def test_cpu_attention_memory_is_linear_in_tokens():
    # 16k tokens: a (tokens x tokens) fp32 matrix would be 1 GiB; the op's whole growth
    # (inputs' gradients, out, lse, per-thread blocks) stays under 64 MiB.
    if cpu_ext.load() is None:
        pytest.skip("no C++ kernels here")
    code = MEMORY_PROBE.format(s=16384, w=4096)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.strip()) < 64, result.stdout


def test_kernel_choice_per_device_and_case():
    q = torch.zeros(4, 4, 16)
    v_latent = torch.zeros(4, 4, 8)
    built = cpu_ext.load() is not None
    assert dispatch.choose("cpu", q, q, NO_WINDOW, 0.0, None) == ("cpu_flash" if built else
                                                                  "torch_flash")  # fmt: skip
    assert dispatch.choose("cpu", q.double(), q.double(), NO_WINDOW, 0.0, None) == "torch_flash"
    assert dispatch.choose("cpu", q.double(), q.double(), 8, 0.0, None) == "composed"
    half = q.half()
    assert dispatch.choose("cuda", half, half, 8, 0.0, None) == "cuda_flash"
    assert dispatch.choose("cuda", half, v_latent.half(), NO_WINDOW, 0.0, None) == "cuda_flash"
    assert dispatch.choose("cuda", half, half, NO_WINDOW, 30.0, None) in ("flex", "composed")
    narrow = torch.empty(4, 2, 8)  # flex_attention refuses heads under 16 channels
    assert dispatch.choose("cuda", narrow, narrow, NO_WINDOW, 30.0, None) == "composed"
    assert dispatch.choose("npu", half, half, 8, 0.0, None) == "npu_fusion"
    assert dispatch.choose("npu", half, half, 8, 30.0, None) == "composed"


def test_each_refused_kernel_says_why():
    """Cases a CUDA or NPU kernel cannot take, asked on CPU: each refusal names its reason,
    `dispatch` lists the refusals of the kernels faster than the one it picks."""
    case = dispatch.Case("cuda", torch.float32, 64, 64, NO_WINDOW, 0.0, False)
    assert "fp16 or bf16, not float32" in dispatch.SUPPORTS["cuda_flash"](case)
    assert "at most 256 channels" in dispatch.SUPPORTS["cuda_flash"](case._replace(dtype=torch.bfloat16, head_dim=320))
    assert "soft cap" in dispatch.SUPPORTS["cuda_flash"](case._replace(softcap=30.0))
    assert "multiple of 16" in dispatch.SUPPORTS["flex"](case._replace(head_dim=8, v_dim=8))
    npu = case._replace(device="npu", dtype=torch.bfloat16)
    assert dispatch.SUPPORTS["npu_fusion"](npu) is None
    assert "soft cap" in dispatch.SUPPORTS["npu_fusion"](npu._replace(softcap=30.0))
    assert "as wide as the keys" in dispatch.SUPPORTS["npu_fusion"](npu._replace(v_dim=32))
    assert dispatch.SUPPORTS["cpu_flash"](npu) == "runs on CPU only"
    kernel, refused = dispatch.dispatch(npu._replace(softcap=30.0))
    assert kernel == "composed" and list(refused) == ["npu_fusion"]
    kernel, refused = dispatch.dispatch(case._replace(dtype=torch.float16, head_dim=8, v_dim=8, softcap=5.0))
    assert kernel == "composed" and set(refused) == {"cuda_flash", "flex"}
    assert "fp64" in dispatch.SUPPORTS["cpu_flash"](case._replace(device="cpu", dtype=torch.float64))


def test_the_choice_is_logged_once_per_case_and_every_call_when_asked(caplog, monkeypatch):
    q = torch.zeros(4, 2, 16, dtype=torch.float64)
    monkeypatch.setattr(dispatch, "_explained", set())
    monkeypatch.delenv("MINDSPEED_ATTENTION_DEBUG", raising=False)
    with caplog.at_level("INFO", logger="mindspeed.ops.attention"):
        for _ in range(3):
            dispatch.choose("cpu", q, q, 8, 0.0, None)  # fp64 with a window: composed
    lines = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert len(lines) == 1 and "composed" in lines[0], lines
    assert "cpu_flash: takes fp32, bf16 or fp16, not fp64" in lines[0], lines
    assert "torch_flash: takes no sliding window" in lines[0], lines
    caplog.clear()
    monkeypatch.setenv("MINDSPEED_ATTENTION_DEBUG", "1")
    with caplog.at_level("INFO", logger="mindspeed.ops.attention"):
        for _ in range(3):
            dispatch.choose("cpu", q, q, 8, 0.0, None)
    assert len([r for r in caplog.records if r.levelname == "INFO"]) == 3


@pytest.mark.parametrize("impl", ["cpu", "reference"])
def test_the_backward_takes_sinks_and_keys_of_their_own_documents(impl):
    """`attention_backward` from `attention`'s own out and lse, with sinks and cu_seqlens_k
    (replies over a shared prompt): autograd's gradients of q, k, v and the sinks."""
    gen = torch.Generator().manual_seed(4)
    cu_q, cu_k = torch.tensor([0, 5, 12]), torch.tensor([0, 9, 20])
    offsets = torch.tensor([4, 4])
    q = torch.randn(12, 4, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(20, 2, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(20, 2, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(12, 4, 16, generator=gen, dtype=torch.float64)
    kwargs = dict(cu_seqlens=cu_q, cu_seqlens_k=cu_k, offsets=offsets, sinks=sinks, window=6)
    out, lse = mo.attention(q, k, v, return_lse=True, impl="reference", **kwargs)
    (out * dout).sum().backward()
    grads = mo.attention_backward(dout, q.detach(), k.detach(), v.detach(), out.detach(),
                                  lse.detach(), impl=impl, **kwargs)  # fmt: skip
    assert len(grads) == 4
    for got, want in zip(grads, (q.grad, k.grad, v.grad, sinks.grad), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32 inside the kernels
    assert sinks.grad.abs().min() > 0  # the sinks' gradient is live


def test_flex_mask_is_the_documents_masks():
    # FlexAttention (the CUDA kernel for soft caps and ring offsets) sees this mask: block
    # diagonal over the documents, each block the reference's mask with its offset.
    from torch.nn.attention.flex_attention import create_mask

    cu, offsets = torch.tensor([0, 70, 71, 128]), torch.tensor([3, 0, 10])
    for causal, window in [(True, 20), (False, 9), (True, NO_WINDOW)]:
        mod = kernels.flex_mask_mod(cu, cu, offsets, causal, window, "cpu")
        dense = create_mask(mod, 1, 1, 128, 128, device="cpu")[0, 0]
        want = torch.zeros(128, 128, dtype=torch.bool)
        for (a, b), off in zip([(0, 70), (70, 71), (71, 128)], offsets.tolist(), strict=True):
            want[a:b, a:b] = kernels.allowed(b - a, b - a, causal, window, off, "cpu")
        assert torch.equal(dense, want), (causal, window)


@pytest.mark.slow
def test_flex_forward_equals_the_reference_on_cpu():
    # Its CPU forward (compiled, inference only, no lse there) end to end: mask, soft cap,
    # GQA, a narrower value head.
    (q, k, v), cu = _inputs([70, 1, 57], 4, 2, 16, 8, torch.float32)
    offsets = torch.tensor([3, 0, 10])
    for causal, window, softcap in [(True, 20, 30.0), (False, 9, 0.0)]:
        with torch.no_grad():
            got, _ = kernels.flex_run(q, k, v, cu, cu, offsets, causal, window, softcap, 0.25,
                                      lse=False)  # fmt: skip
        want = mo.attention_reference(q, k, v, causal=causal, window=window, cu_seqlens=cu,
                                      scale=0.25, softcap=softcap or None, offsets=offsets)
        torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)


def test_split_heads_add_up_their_key_gradients():
    # One document and one kv head for four threads: the backward splits the query heads over
    # items that add their dk/dv under a lock; the result is the unsplit one.
    if cpu_ext.load() is None:
        pytest.skip("no C++ kernels here")
    (q, k, v), cu = _inputs([333], 4, 1, 16, 16, torch.float32)
    gen = torch.Generator().manual_seed(1)
    dout, dlse = torch.randn(333, 4, 16, generator=gen), torch.randn(4, 333, generator=gen)
    want = _reference_grads(q, k, v, cu, True, 40, 0.0, None, dout, dlse)
    threads = torch.get_num_threads()
    try:
        for count in (1, 4):
            torch.set_num_threads(count)
            got = _kernel_run("cpu_flash", q, k, v, cu, True, 40, 0.0, None, dout, dlse)
            for g, w in zip(got[2], want[2], strict=True):
                torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_recomputing_kernel_backward_through_the_custom_op(monkeypatch):
    # flex and npu_fusion differentiate their own forward again in the backward; a custom op's
    # body records no autograd graph, so that backward must run outside it. Here flex_run is
    # the reference (flex has no CPU backward) and the whole op's gradients are checked.
    import importlib

    attention_op = importlib.import_module("mindspeed_ops.attention")

    def reference_run(q, k, v, cu_q, cu_k, offsets, causal, window, softcap, scale, *, lse=True):
        return mo.attention_reference(
            q, k, v, causal=causal, window=None if window == NO_WINDOW else window,
            cu_seqlens=cu_q, scale=scale, softcap=softcap or None, offsets=offsets,
        )  # fmt: skip

    monkeypatch.setattr(kernels, "flex_run", reference_run)
    (q, k, v), cu = _inputs([9, 1, 14], 4, 2, 16, 16, torch.float64)
    dout, dlse = torch.randn(24, 4, 16, dtype=torch.float64), torch.randn(4, 24).double()
    want = _reference_grads(q, k, v, cu, True, 5, 0.0, None, dout, dlse)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_op._attention_fwd(*leaves, cu, cu, None, True, 5, 0.0, 0.25, "flex")
    grads = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    torch.testing.assert_close(out, want[0])
    for got, ref in zip(grads, want[2], strict=True):
        torch.testing.assert_close(got, ref)


def test_packed_boundaries_are_read_once_per_tensor(monkeypatch):
    """Every layer's attention reads cu_seqlens on the host (checks, kernel sizes); on a GPU
    each read stalls the device, so a tensor is read once, and again only after an in-place
    write (which must not leave stale boundaries behind)."""
    from mindspeed_ops import validate

    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real(t))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q = torch.randn(8, 2, 8, requires_grad=True)
    k, v = torch.randn(8, 1, 8), torch.randn(8, 1, 8)
    for _ in range(3):  # three "layers", forward and backward
        mo.attention(q, k, v, cu_seqlens=cu, impl="cpu").sum().backward()
    assert len(reads) == 1
    cu[1] = 5  # written in place: read again, and the new boundaries are the ones used
    out = mo.attention(q, k, v, cu_seqlens=cu, impl="cpu")
    assert len(reads) == 2 and validate.host_values(cu) == [0, 5, 8]
    ref = mo.attention(q, k, v, cu_seqlens=torch.tensor([0, 5, 8]), impl="reference")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["cpu", "reference"])
def test_queries_over_keys_of_their_own_documents_equal_the_whole_sequence(impl):
    """cu_seqlens_k: two replies sharing one prompt, each reply's queries over [prompt, its
    own tokens] with the prompt's length as offset, give the rows (and the gradients) of
    causal attention over each whole [prompt, reply] sequence."""
    torch.manual_seed(0)
    prompt, replies = 5, (4, 3)
    q_all = [torch.randn(prompt + n, 4, 8, dtype=torch.float64) for n in replies]
    kv_prompt = torch.randn(prompt, 2, 8, dtype=torch.float64), torch.randn(prompt, 2, 8, dtype=torch.float64)
    kv_reply = [(torch.randn(n, 2, 8, dtype=torch.float64), torch.randn(n, 2, 8, dtype=torch.float64))
                for n in replies]  # fmt: skip
    dtype = torch.float32 if impl == "cpu" else torch.float64
    leaves = [t.to(dtype).requires_grad_() for t in (*kv_prompt, *(x for kv in kv_reply for x in kv))]
    kp, vp, k1, v1, k2, v2 = leaves
    qs = [t[prompt:].to(dtype).requires_grad_() for t in q_all]
    # shared: the queries of both replies, the keys [prompt, reply 1, prompt, reply 2]
    k = torch.cat([kp, k1, kp, k2])
    v = torch.cat([vp, v1, vp, v2])
    q = torch.cat(qs)
    cu_q = torch.tensor([0, replies[0], sum(replies)])
    cu_k = torch.tensor([0, prompt + replies[0], 2 * prompt + sum(replies)])
    out = mo.attention(q, k, v, cu_seqlens=cu_q, cu_seqlens_k=cu_k, offsets=torch.tensor([prompt, prompt]),
                       impl=impl)  # fmt: skip
    cot = torch.randn_like(out)
    grads = torch.autograd.grad((out * cot).sum(), [*qs, *leaves])
    # separately: each whole sequence, its reply's rows
    expected, row = [], 0
    for i, (kr, vr) in enumerate(((k1, v1), (k2, v2))):
        n = replies[i]
        qw = torch.cat([torch.zeros(prompt, 4, 8, dtype=dtype), qs[i]])
        whole = mo.attention(qw[None], torch.cat([kp, kr])[None], torch.cat([vp, vr])[None],
                             impl="reference")[0]  # fmt: skip
        expected.append(whole[prompt:])
        row += n
    ref = torch.cat(expected)
    ref_grads = torch.autograd.grad((ref * cot).sum(), [*qs, *leaves])
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_keys_of_their_own_documents_are_checked():
    q, k = torch.randn(4, 2, 8), torch.randn(6, 2, 8)
    with pytest.raises(ValueError, match="cu_seqlens_k has 1 documents but cu_seqlens 2"):
        mo.attention(q, k, k, cu_seqlens=torch.tensor([0, 2, 4]), cu_seqlens_k=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="cu_seqlens_k needs cu_seqlens"):
        mo.attention(q[None], k[None], k[None], cu_seqlens_k=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="ends at 5 but the packed input has 6"):
        mo.attention(q, k, k, cu_seqlens=torch.tensor([0, 4]), cu_seqlens_k=torch.tensor([0, 5]))
