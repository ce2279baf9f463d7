"""Qwen3-MoE in Hugging Face's spelling: Qwen3's keys with `num_experts` of
`moe_intermediate_size` (no shared expert); per-expert weights
`mlp.experts.E.{gate,up,down}_proj`."""

from mindspeed_llm.models.common.hf_config import QWEN_WINDOW, decoder_format, qwen_experts
from mindspeed_llm.models.common.moe_hf_adapter import MoEAdapter

FORMAT = decoder_format(
    "qwen3_moe",
    "Qwen3MoeForCausalLM",
    flags={"qk_norm": True},
    window=QWEN_WINDOW,
    experts=qwen_experts(shared_expert=False),
)
ADAPTER = MoEAdapter()
