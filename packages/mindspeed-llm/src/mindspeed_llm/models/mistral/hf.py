"""Mistral in Hugging Face's spelling: the shared decoder keys and a plain `sliding_window`."""

from mindspeed_llm.models.common.hf_config import MISTRAL_WINDOW, decoder_format

FORMAT = decoder_format("mistral", "MistralForCausalLM", window=MISTRAL_WINDOW)
