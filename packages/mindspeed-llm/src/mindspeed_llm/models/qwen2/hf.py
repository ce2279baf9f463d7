"""Qwen2 in Hugging Face's spelling: q/k/v biases always (no key says so), Qwen's
`use_sliding_window` / `max_window_layers`."""

from mindspeed_llm.models.common.hf_config import QWEN_WINDOW, decoder_format

FORMAT = decoder_format("qwen2", "Qwen2ForCausalLM", flags={"qkv_bias": True}, window=QWEN_WINDOW)
