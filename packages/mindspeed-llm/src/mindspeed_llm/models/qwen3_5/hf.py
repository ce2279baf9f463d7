"""Qwen3.5 text in Hugging Face's spelling (`Qwen3_5ForCausalLM`, model_type qwen3_5_text):
Qwen3-Next's keys without experts; the linear blocks hold `linear_attn.in_proj_qkv`,
`in_proj_z`, `in_proj_b`, `in_proj_a` (regrouped per key head into ours). A multimodal
config (`qwen3_5`, the language model in `text_config`) reads as its language model; its
checkpoints' `model.language_model.*` weights read as its language model (the vision tower and
`mtp.*` skipped); what we write back is the text model alone."""

from mindspeed_llm.models.qwen3_next.hf import Qwen3NextAdapter, hybrid_format

FORMAT = hybrid_format("qwen3_5_text", "Qwen3_5ForCausalLM", experts=False)
ADAPTER = Qwen3NextAdapter(split_projections=True)
