"""`mindspeed convert`: Hugging Face, MindSpeed (DCP), Megatron (legacy and torch_dist) and
peft checkpoints, one tensor at a time.

- `cli`: the command's flags and which route they pick;
- `hf`: Hugging Face <-> MindSpeed, through the family's map in `mindspeed_llm.models`;
- `megatron`: Megatron's formats both ways, from one two-way table (`megatron.mapping`);
- `peft`: a LoRA run merged into Hugging Face weights, or as a peft adapter;
- `staging`, `hf_out`, `dcp_stream`, `lora_merge`: the streaming machinery they share.
"""

from mindspeed_tools.convert.cli import DTYPES, command, main
from mindspeed_tools.convert.hf import AdamSource, hf_to_mindspeed, mindspeed_to_hf
from mindspeed_tools.convert.hf_out import plan_shards
from mindspeed_tools.convert.megatron.routes import (
    hf_to_megatron,
    megatron_to_hf,
    megatron_to_mindspeed,
)
from mindspeed_tools.convert.peft import lora_to_peft, merge_lora_to_hf
from mindspeed_tools.convert.staging import parse_size

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
