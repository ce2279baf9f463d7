"""Mixtral sizes (Mistral attention, 8 routed SwiGLU experts, top-2): debug and 8x7B."""

from dataclasses import replace

from mindspeed_llm.models.common.family import debug_flavor
from mindspeed_llm.models.mistral.flavors import MISTRAL_7B

FLAVORS = {
    "debug": debug_flavor(
        "mixtral",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        router_aux_loss_coef=0.01,
    ),
    # mistralai/Mixtral-8x7B-v0.1: Mistral-7B's shape, full attention, 8 experts.
    "mixtral-8x7b": replace(
        MISTRAL_7B,
        family="mixtral",
        rope_theta=1000000.0,
        sliding_window=None,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=14336,
        router_aux_loss_coef=0.02,
    ),
}
