"""Our checkpoints written as Hugging Face folders, streamed one tensor at a time, and the DCP
streaming they need (`dcp_stream`). It lives with the models, in mindspeed-llm, so that the
trainer's `logging.hf_export_every` calls it in process; `mindspeed convert --to hf`
(mindspeed-tools) calls the same functions."""

from mindspeed_llm.hf_export.writer import lora_source, merge_lora_to_hf, mindspeed_to_hf

__all__ = ["lora_source", "merge_lora_to_hf", "mindspeed_to_hf"]
