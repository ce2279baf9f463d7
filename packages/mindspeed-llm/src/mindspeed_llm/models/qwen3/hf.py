"""Qwen3 in Hugging Face's spelling: per-head q/k norms always (no key says so), Qwen's
sliding-window keys."""

from mindspeed_llm.models.common.hf_config import QWEN_WINDOW, decoder_format

FORMAT = decoder_format("qwen3", "Qwen3ForCausalLM", flags={"qk_norm": True}, window=QWEN_WINDOW)
