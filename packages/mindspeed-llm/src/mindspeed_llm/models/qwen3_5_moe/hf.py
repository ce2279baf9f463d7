"""Qwen3.5-MoE text in Hugging Face's spelling (`Qwen3_5MoeForCausalLM`, model_type
qwen3_5_moe_text): Qwen3.5's linear-block projections (see `qwen3_5.hf`) with Qwen3-Next's
experts (a gated shared expert) in every block, their top-k weights always renormalised."""

from mindspeed_llm.models.qwen3_next.hf import Qwen3NextAdapter, hybrid_format

FORMAT = hybrid_format(
    "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", experts=True, every_block_moe=True
)
ADAPTER = Qwen3NextAdapter(split_projections=True)
