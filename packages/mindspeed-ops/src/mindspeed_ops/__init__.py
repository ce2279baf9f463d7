"""MindSpeed fused operators: one API, a PyTorch reference, CPU/CUDA/NPU backends.

Every op takes `impl="auto" | "reference" | "cpu" | "cuda" | "npu"`; see README.md.
"""

from mindspeed_ops.attention import attention, attention_backward, attention_reference
from mindspeed_ops.backends import IMPLS, available_impls, resolve_impl
from mindspeed_ops.causal_conv1d import causal_conv1d
from mindspeed_ops.cross_entropy import (
    cross_entropy,
    cross_entropy_reference,
    linear_cross_entropy,
    linear_cross_entropy_reference,
)
from mindspeed_ops.gated_delta_rule import (
    gated_delta_rule,
    gated_delta_rule_reference,
    gated_delta_rule_step,
)
from mindspeed_ops.grouped_matmul import grouped_matmul, grouped_matmul_reference
from mindspeed_ops.linear import linear, linear_reference
from mindspeed_ops.matmul_add import matmul_add, matmul_add_reference
from mindspeed_ops.nf4 import (
    NF4_LEVELS,
    nf4_dequantize,
    nf4_dequantize_reference,
    nf4_quantize,
    nf4_quantize_reference,
)
from mindspeed_ops.rms_norm import rms_norm, rms_norm_reference
from mindspeed_ops.rotary import (
    position_ids_from_cu_seqlens,
    rotary_embedding,
    rotary_reference,
    rotary_tables,
)
from mindspeed_ops.swiglu import swiglu, swiglu_reference

__version__ = "0.1.0"

__all__ = [
    "IMPLS",
    "NF4_LEVELS",
    "attention",
    "attention_backward",
    "attention_reference",
    "available_impls",
    "causal_conv1d",
    "cross_entropy",
    "cross_entropy_reference",
    "gated_delta_rule",
    "gated_delta_rule_reference",
    "gated_delta_rule_step",
    "grouped_matmul",
    "grouped_matmul_reference",
    "linear",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "linear_reference",
    "matmul_add",
    "matmul_add_reference",
    "nf4_dequantize",
    "nf4_dequantize_reference",
    "nf4_quantize",
    "nf4_quantize_reference",
    "position_ids_from_cu_seqlens",
    "resolve_impl",
    "rms_norm",
    "rms_norm_reference",
    "rotary_embedding",
    "rotary_reference",
    "rotary_tables",
    "swiglu",
    "swiglu_reference",
]
