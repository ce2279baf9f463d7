"""MiniMax-M2 (transformers' `minimax_m2`): the shared decoder with GQA, RoPE on half of
each head (`rotary_dim`), one q and one k RMSNorm over all heads (`qk_norm_scope="all"`)
and sigmoid-routed experts with the balancing bias in every block (no shared expert);
sizes in flavors.py, Hugging Face spelling, weight names and the q/k row permutation in
hf.py. Layouts: tp (+SP), ep, pp and cp as the shared decoder; under tp the norm over all
heads sums its squares over the tp ranks (`common.norm.rms_norm_over_ranks`)."""

from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.minimax_m2 import flavors, hf

SPEC = decoder_family("minimax_m2", flavors.FLAVORS, hf.FORMAT, hf_adapter=hf.ADAPTER)
