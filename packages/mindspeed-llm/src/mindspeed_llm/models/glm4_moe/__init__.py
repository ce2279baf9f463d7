"""GLM-4.5 / 4.6 (transformers' `glm4_moe`): the shared decoder with q/k/v biases, optional
per-head qk-norm, RoPE on half of each head (`rotary_dim`), DeepSeek-V3's routing (sigmoid
scores with the balancing bias, expert groups, routed_scaling_factor), ungated shared
experts, dense first blocks and multi-token prediction modules (`common.mtp`); sizes in
flavors.py, Hugging Face spelling, weight names and the q/k row permutation in hf.py.
Layouts: tp (+SP), ep, pp and cp as the shared decoder; MTP modules only with tp = pp =
cp = 1 (see `common.layout`)."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.glm4_moe import flavors, hf

SPEC = decoder_family("glm4_moe", flavors.FLAVORS, hf.FORMAT, hf_adapter=hf.ADAPTER)
