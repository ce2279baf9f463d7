"""Llama in Hugging Face's spelling: the shared decoder keys, nothing more."""

from mindspeed_llm.models.common.hf_config import decoder_format

FORMAT = decoder_format("llama", "LlamaForCausalLM")
