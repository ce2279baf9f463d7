"""`mindspeed convert`: Hugging Face, MindSpeed (DCP), Megatron (legacy and torch_dist) and
peft checkpoints, one tensor at a time.

- `cli`: the command's flags and which route they pick;
- `hf`: Hugging Face -> MindSpeed, through the family's map in `mindspeed_llm.models`; the
  other way (and a LoRA run merged) is `mindspeed_llm.hf_export`, which the trainer's
  `logging.hf_export_every` also calls, with the streaming pieces both directions share;
- `megatron`: Megatron's formats both ways, from one two-way table (`megatron.mapping`);
- `peft`: a LoRA run as a peft adapter.
"""

from mindspeed_llm.hf_export import merge_lora_to_hf, mindspeed_to_hf
from mindspeed_llm.hf_export.hf_out import plan_shards
from mindspeed_tools.convert.cli import DTYPES, command, main, parse_size
from mindspeed_tools.convert.hf import AdamSource, hf_to_mindspeed
from mindspeed_tools.convert.megatron.routes import (
    hf_to_megatron,
    megatron_to_hf,
    megatron_to_mindspeed,
)
from mindspeed_tools.convert.peft import lora_to_peft

__all__ = [
    "DTYPES",
    "AdamSource",
    "command",
    "hf_to_megatron",
    "hf_to_mindspeed",
    "lora_to_peft",
    "main",
    "megatron_to_hf",
    "megatron_to_mindspeed",
    "merge_lora_to_hf",
    "mindspeed_to_hf",
    "parse_size",
    "plan_shards",
]
