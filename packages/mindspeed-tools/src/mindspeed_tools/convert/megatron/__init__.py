"""Megatron-LM / Megatron-Core checkpoints, read without running code, and written.

Read: a save folder in either format (`legacy` per-rank files, `torch_dist`), merged over
tp/pp/ep and virtual-pipeline chunks, as Hugging Face tensors, one at a time (memory holds
about the largest tensor, never the model); with `--with-optimizer`, Adam's state too
(`optim`). Written: Hugging Face Llama/Mistral/Qwen2/Qwen3 folders as the legacy per-rank
format at a chosen tp/pp. The model's shape comes from the saved args (`config`).

Dense Llama/Mistral/Qwen2/Qwen3-style models (RMSNorm, SwiGLU, RoPE) are read, and their
MoE kin with softmax top-k routing and no shared expert: Mixtral (no qk-norm) and Qwen3-MoE
(qk-norm). What is not converted (shared experts, sigmoid or group-limited routing, uneven
stages) is refused by the arg that asks for it.

Both directions take their names and layouts from one table, `mapping.RULES`.
"""

from mindspeed_tools.convert.megatron.config import hf_config, megatron_args
from mindspeed_tools.convert.megatron.files import (
    COMMON_FILE,
    LATEST_FILE,
    LEGACY_FILE,
    MegatronTensors,
    is_megatron_checkpoint,
    safe_torch_load,
)
from mindspeed_tools.convert.megatron.legacy import to_megatron
from mindspeed_tools.convert.megatron.mapping import split_qkv, to_hf_tensors
from mindspeed_tools.convert.megatron.read import read_checkpoint
from mindspeed_tools.convert.megatron.routes import (
    hf_to_megatron,
    megatron_to_hf,
    megatron_to_mindspeed,
)

__all__ = [
    "COMMON_FILE",
    "LATEST_FILE",
    "LEGACY_FILE",
    "MegatronTensors",
    "hf_config",
    "hf_to_megatron",
    "is_megatron_checkpoint",
    "megatron_args",
    "megatron_to_hf",
    "megatron_to_mindspeed",
    "read_checkpoint",
    "safe_torch_load",
    "split_qkv",
    "to_hf_tensors",
    "to_megatron",
]
