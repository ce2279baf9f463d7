"""Lines for `mindspeed env` (entry-point group `mindspeed.env`); never triggers a build."""

from __future__ import annotations

from mindspeed_ops import cpu_ext
from mindspeed_ops.backends import available_impls, cuda_available, has_module, npu_available

OPS = (
    "rms_norm",
    "swiglu",
    "rotary_embedding",
    "attention",
    "cross_entropy",
    "grouped_matmul",
    "matmul_add",
    "gated_delta_rule",
)


def _kernel(op: str, device: str) -> str:
    """What impl="auto" runs for `op` on `device`, in words."""
    if device == "npu":
        torch_npu_ops = ("rms_norm", "swiglu", "rotary_embedding", "grouped_matmul")
        return "npu (torch_npu)" if op in torch_npu_ops else "npu (composed torch)"
    if device == "cuda":
        if op in ("rms_norm", "swiglu"):
            return "cuda (liger-kernel)" if has_module("liger_kernel") else "cuda (composed torch)"
        if op == "rotary_embedding":
            return "reference"
        if op == "attention":
            return "cuda (torch SDPA; composed torch for packed/window/lse)"
        if op == "gated_delta_rule" and has_module("fla"):
            return "cuda (flash-linear-attention)"
        return "cuda (composed torch)"
    if op in ("rms_norm", "swiglu", "rotary_embedding"):
        return "cpu (C++)" if not cpu_ext.status().startswith("not built:") else "cpu (reference)"
    if op == "attention":
        return "cpu (torch SDPA; composed torch for packed/window/lse)"
    return "cpu (composed torch)"


def info() -> dict[str, object]:
    """{"ops_auto_impl": ..., "ops_cpu_kernels": ..., "ops_impls": ...}."""
    device = "npu" if npu_available() else "cuda" if cuda_available() else "cpu"
    auto = ", ".join(f"{op}={_kernel(op, device)}" for op in OPS)
    return {
        "ops_auto_impl": auto,
        "ops_cpu_kernels": cpu_ext.status(),
        "ops_impls": ", ".join(available_impls()),
    }
