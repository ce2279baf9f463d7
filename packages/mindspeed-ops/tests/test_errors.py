"""Bad input is a clear Python error naming what is wrong, never a crash inside a kernel."""

from __future__ import annotations

import pytest
import torch

import mindspeed_ops as mo


def test_unknown_impl_names_the_allowed_values():
    with pytest.raises(ValueError, match="impl='triton' is not one of 'auto', 'reference'"):
        mo.rms_norm(torch.randn(2, 4), impl="triton")


def test_impl_must_match_the_device():
    with pytest.raises(ValueError, match="impl='cuda' cannot run on a tensor on device 'cpu'"):
        mo.swiglu(torch.randn(2, 4), impl="cuda")


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: mo.rms_norm(torch.ones(2, 4, dtype=torch.int64)), TypeError, "x must be a floating"),
        (lambda: mo.rms_norm(torch.randn(2, 4), torch.randn(5)), ValueError, r"weight shape \(5,\)"),
        (lambda: mo.rms_norm([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
        (lambda: mo.swiglu(torch.randn(2, 5)), ValueError, "even last dimension, got 5"),
        (lambda: mo.swiglu(torch.randn(2, 4), torch.randn(2, 3)), ValueError, "y shape"),
        (lambda: mo.swiglu(torch.randn(2, 4), torch.randn(2, 4).bfloat16()), TypeError, "y has dtype"),
    ],
    ids=["int-x", "weight-shape", "not-tensor", "odd-fused", "swiglu-shape", "swiglu-dtype"],
)  # fmt: skip
def test_pointwise_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_rotary_errors():
    cos, sin = mo.rotary_tables(8, 10)
    x = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"position_ids must lie in \[0, 10\)"):
        mo.rotary_embedding(x, cos, sin, torch.tensor([0, 1, 2, 10]), impl="cpu")
    with pytest.raises(ValueError, match="rot_dim 8 exceeds head_dim 6"):
        mo.rotary_embedding(torch.randn(1, 4, 2, 6), cos, sin, impl="cpu")
    with pytest.raises(TypeError, match="position_ids must be an int32 or int64"):
        mo.rotary_embedding(x, cos, sin, torch.zeros(4), impl="cpu")
    with pytest.raises(ValueError, match=r"position_ids shape \(3,\)"):
        mo.rotary_embedding(x, cos, sin, torch.tensor([0, 1, 2]), impl="cpu")


def test_attention_errors():
    q, k = torch.randn(10, 4, 8), torch.randn(10, 2, 8)
    with pytest.raises(ValueError, match="cu_seqlens ends at 9 but the packed input has 10"):
        mo.attention(q, k, k, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        mo.attention(q, k, k, cu_seqlens=torch.tensor([0, 6, 4, 10]))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        mo.attention(q, k, k, cu_seqlens=torch.tensor([1, 10]))
    with pytest.raises(TypeError, match="cu_seqlens must be an int32 or int64"):
        mo.attention(q, k, k, cu_seqlens=torch.tensor([0.0, 10.0]))
    with pytest.raises(ValueError, match="heads_q=4 is not a multiple of heads_kv=3"):
        mo.attention(
            q, torch.randn(10, 3, 8), torch.randn(10, 3, 8), cu_seqlens=torch.tensor([0, 10])
        )
    with pytest.raises(ValueError, match=r"q must be \(batch, seq, heads, head_dim\)"):
        mo.attention(q, k, k)
    with pytest.raises(TypeError, match="k has dtype torch.bfloat16"):
        mo.attention(q[None], k[None].bfloat16(), k[None])
    with pytest.raises(ValueError, match="window must be a positive int"):
        mo.attention(q[None], k[None], k[None], window=0)
    with pytest.raises(ValueError, match="must agree on all dims but heads"):
        mo.attention(q[None], k[None, :5], k[None, :5])  # causal needs equal lengths
    with pytest.raises(ValueError, match="softcap must be a positive number or None, got -1"):
        mo.attention(q[None], k[None], k[None], softcap=-1.0)
    with pytest.raises(ValueError, match=r"offsets must have one entry per sequence \(2\)"):
        mo.attention(q, k, k, cu_seqlens=torch.tensor([0, 4, 10]), offsets=torch.tensor([0]))
    with pytest.raises(ValueError, match=r"k shape \(10, 2, 8\) and v shape \(9, 2, 8\)"):
        mo.attention(q, k, k[:9], cu_seqlens=torch.tensor([0, 10]))


def test_loss_and_gemm_errors():
    logits = torch.randn(4, 10)
    with pytest.raises(ValueError, match=r"target holds 10, outside \[0, 10\)"):
        mo.cross_entropy(logits, torch.tensor([0, 1, 10, -100]))
    with pytest.raises(ValueError, match=r"target shape \(3,\) != \(4,\)"):
        mo.cross_entropy(logits, torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="target must be an int32 or int64"):
        mo.cross_entropy(logits, torch.zeros(4))
    with pytest.raises(ValueError, match="reduction='avg'"):
        mo.cross_entropy(logits, torch.zeros(4, dtype=torch.long), reduction="avg")
    with pytest.raises(ValueError, match=r"hidden \(4, 3\) must be"):
        mo.linear_cross_entropy(torch.randn(4, 3), torch.randn(10, 5), torch.zeros(4).long())
    x, w = torch.randn(6, 3), torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match=r"group_sizes \[2, 3\] must be non-negative and sum to 6"):
        mo.grouped_matmul(x, w, torch.tensor([2, 3]))
    with pytest.raises(ValueError, match="must be non-negative"):
        mo.grouped_matmul(x, w, torch.tensor([7, -1]))
    with pytest.raises(ValueError, match=r"group_sizes shape \(3,\) != \(2,\) groups"):
        mo.grouped_matmul(x, w, torch.tensor([2, 2, 2]))
    with pytest.raises(TypeError, match="main_grad must be float32"):
        mo.matmul_add(torch.randn(4, 2), torch.randn(4, 3), torch.zeros(2, 3).bfloat16())
    with pytest.raises(ValueError, match=r"main_grad shape \(3, 2\) != \(2, 3\)"):
        mo.matmul_add(torch.randn(4, 2), torch.randn(4, 3), torch.zeros(3, 2))


def test_cpp_checks_are_exceptions_not_crashes():
    # Calling the extension directly with bad input (bypassing the wrappers) raises.
    from mindspeed_ops import cpu_ext

    ext = cpu_ext.load()
    if ext is None:
        pytest.skip("C++ kernels not built here")
    with pytest.raises(ValueError, match=r"position_ids must lie in \[0, 3\)"):
        ext.rotary(torch.randn(2, 1, 4), torch.tensor([0, 9]), torch.ones(3, 2), torch.ones(3, 2),
                   False, False)  # fmt: skip
    with pytest.raises(RuntimeError, match="must be float32 or bfloat16"):
        ext.rms_norm_fwd(torch.ones(2, 3, dtype=torch.float64), None, 1e-6)
    with pytest.raises(RuntimeError, match="weight must have one element per hidden channel"):
        ext.rms_norm_fwd(torch.ones(2, 3), torch.ones(4), 1e-6)
