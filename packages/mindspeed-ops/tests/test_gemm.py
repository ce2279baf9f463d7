"""grouped_matmul and matmul_add against their references."""

from __future__ import annotations

import importlib

import pytest
import torch

import mindspeed_ops as mo

# bf16 GEMMs accumulate in fp32 but round each output; K up to 40 keeps the error near 1 ulp.
GEMM_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 2e-2)}


def _g(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("sizes", [[3, 0, 5, 1], [1], [0, 0, 7]], ids=str)
def test_grouped_matmul_parity(parity, backend, dtype, sizes):
    tokens, groups = sum(sizes), len(sizes)
    group_sizes = torch.tensor(sizes, device=backend)
    parity(
        lambda x, weight: mo.grouped_matmul(x, weight, group_sizes, impl=backend),
        lambda x, weight: mo.grouped_matmul_reference(x, weight, group_sizes),
        {"x": _g(tokens, 40), "weight": _g(groups, 40, 19, seed=1)},
        dtype, backend, GEMM_TOL[dtype],
    )  # fmt: skip


def test_grouped_matmul_equals_per_expert_matmul():
    x, w = _g(6, 5), _g(2, 5, 3, seed=1)
    out = mo.grouped_matmul(x, w, torch.tensor([2, 4]), impl="cpu")
    torch.testing.assert_close(out[:2], x[:2] @ w[0])
    torch.testing.assert_close(out[2:], x[2:] @ w[1])


def test_matmul_add_accumulates_in_fp32(backend, dtype):
    dy, x = _g(2, 9, 17).to(backend, dtype), _g(2, 9, 33, seed=1).to(backend, dtype)
    main_grad = _g(17, 33, seed=2).to(backend)
    want = mo.matmul_add_reference(dy, x, main_grad)
    got = mo.matmul_add(dy, x, main_grad.clone(), impl=backend)
    assert got.dtype == torch.float32
    atol, rtol = GEMM_TOL[torch.float32]  # the inputs are exact in fp32 either way
    torch.testing.assert_close(got, want, atol=atol * 10, rtol=rtol * 10)


def test_matmul_add_is_in_place_and_chunks_low_precision(monkeypatch):
    module = importlib.import_module("mindspeed_ops.matmul_add")

    monkeypatch.setattr(module, "_CHUNK_ROWS", 4)  # force several chunks over 10 tokens
    dy, x = _g(10, 3).bfloat16(), _g(10, 5, seed=1).bfloat16()
    main_grad = torch.ones(3, 5)
    returned = mo.matmul_add(dy, x, main_grad, impl="cpu")
    assert returned.data_ptr() == main_grad.data_ptr()
    torch.testing.assert_close(main_grad, 1 + dy.float().t() @ x.float(), atol=1e-5, rtol=1e-5)
