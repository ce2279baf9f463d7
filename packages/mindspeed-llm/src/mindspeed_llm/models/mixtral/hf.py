"""Mixtral in Hugging Face's spelling: Mistral's keys with `num_local_experts` experts as
wide as `intermediate_size`; per-expert weights `block_sparse_moe.experts.E.{w1,w3,w2}`."""

from mindspeed_llm.models.common.hf_config import MISTRAL_WINDOW, MIXTRAL_EXPERTS, decoder_format
from mindspeed_llm.models.common.moe_hf_adapter import W1_W3_W2, MoEAdapter

FORMAT = decoder_format(
    "mixtral", "MixtralForCausalLM", window=MISTRAL_WINDOW, experts=MIXTRAL_EXPERTS
)
ADAPTER = MoEAdapter(expert_names=W1_W3_W2, block="block_sparse_moe")
