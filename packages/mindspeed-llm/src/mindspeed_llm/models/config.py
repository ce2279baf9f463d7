"""`TransformerConfig`: the hyperparameters of our decoder (dense or MoE).

One config describes every family we support (Llama 2/3, Qwen2/2.5, Qwen3, Mistral, and the
MoE ones Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek, GLM-4.5, MiniMax-M2): the families differ
only in flags (qkv bias, qk norm, sliding window, RoPE scaling, experts).
`from_hf` reads a `config.json` written by transformers v4 or v5 and `to_hf_dict` writes one
that both versions read, each through the family's `HFFormat` (its `hf.py`, registered
with the family).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindspeed_core.errors import ConfigError
from mindspeed_llm.models.config_checks import check_families, check_positive_int
from mindspeed_llm.models.hf_format import format_of_family, format_of_model_type, model_types

_OPS_IMPLS = ("auto", "reference", "cpu", "cuda", "npu")
_QK_NORM_SCOPES = ("head", "all")

ROPE_SCALING = {
    "linear": ({"factor"}, {}),
    "llama3": (
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
        {},
    ),
    "yarn": (
        {"factor", "original_max_position_embeddings"},
        {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "attention_factor": None,
            "mscale": None,
            "mscale_all_dim": None,
            "truncate": True,
        },
    ),
}
"""RoPE scaling types: (required fields, optional fields with transformers' defaults)."""


@dataclass(kw_only=True)
class TransformerConfig:
    """A decoder-only transformer (pre-norm, RMSNorm, RoPE, GQA, SwiGLU or routed experts)."""

    family: str = "llama"
    """Model family in the registry (`mindspeed_llm.models.model_families()`), e.g. "llama",
    "qwen3", "mixtral", "deepseek_v3", "glm4_moe", "minimax_m2", or one registered by the
    user."""
    vocab_size: int
    """Tokens of the vocabulary: rows of the embedding and of the output projection,
    unless tensor parallel pads them (`padded_vocab_size`)."""
    vocab_divisible_by: int = 128
    """Under tensor parallel tp > 1, the embedding and output are padded to a multiple of
    vocab_divisible_by x tp rows (Megatron's `--make-vocab-size-divisible-by`); the padding
    rows are never predicted (their logits are cut off, or -inf when vocab-sharded) and
    never saved. Not a Hugging Face field."""
    padded_vocab_size: int | None = None
    """Rows the embedding and output projection hold when more than vocab_size: set by
    `parallelize_decoder` on the model it pads (`padded_vocab`), never by hand."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU feed-forward (each of w1 and w3)."""
    num_layers: int
    """Number of decoder blocks."""
    num_heads: int
    """Query heads per block."""
    num_kv_heads: int | None = None
    """Key/value heads (GQA); must divide num_heads. None: num_heads (MHA)."""
    head_dim: int | None = None
    """Channels per head. None: hidden_size // num_heads."""
    max_position_embeddings: int = 4096
    """Length of the RoPE tables: positions must stay below it."""
    rope_theta: float = 10000.0
    """RoPE base wavelength."""
    rope_scaling: dict[str, Any] | None = None
    """None, or {"type": "linear", "factor"}, {"type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"} or {"type": "yarn", "factor",
    "original_max_position_embeddings", optional "beta_fast", "beta_slow",
    "attention_factor", "mscale", "mscale_all_dim", "truncate"}, as transformers computes them."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    qkv_bias: bool = False
    """Biases on the q, k and v projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over head_dim of each query and key head, before RoPE (Qwen3)."""
    qk_norm_scope: str = "head"
    """With `qk_norm`: "head" (one RMSNorm of width head_dim shared by every head, Qwen3)
    or "all" (one RMSNorm over the whole q projection and one over the whole k projection,
    weights num_heads x head_dim and num_kv_heads x head_dim wide: MiniMax-M2). Under
    tensor parallel "all" shards those weights like wq/wk and sums the squares over the
    tp ranks (one all-reduce of a (batch, seq, 1) tensor per norm)."""
    sliding_window: int | None = None
    """Each query sees only the last `sliding_window` keys, itself included (Mistral v0.1).
    None: full causal attention."""
    tie_word_embeddings: bool = False
    """The output projection shares the embedding matrix."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0: a dense model (every block a `FeedForward`)."""
    num_experts_per_tok: int = 2
    """top_k: experts each token is sent to."""
    moe_intermediate_size: int | None = None
    """Width of each routed expert's SwiGLU. None: intermediate_size."""
    shared_expert_intermediate_size: int = 0
    """Width of the always-on shared expert, gated by sigmoid (Qwen2-MoE); 0: none."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to 1 (Mixtral, Qwen3-MoE)."""
    router_score: str = "softmax"
    """"softmax" (Mixtral, Qwen) or "sigmoid" with an aux-loss-free balancing bias
    (DeepSeek-V3)."""
    router_bias_update_rate: float = 0.0
    """Sigmoid routers: step of the balancing-bias update after each optimizer step."""
    router_aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss (Switch/Mixtral) in the training loss."""
    router_z_loss_coef: float = 0.0
    """Weight of the router z-loss (mean logsumexp(logits)^2, ST-MoE)."""
    router_aux_loss_scope: str = "model"
    """How the load-balancing loss pools its statistics: "model" (Hugging Face's: loads
    and probabilities averaged over all MoE layers, then multiplied) or "layer"
    (Megatron's: each layer's own loss, then the mean over layers). Pipeline parallel
    needs "layer": a stage sees only its own layers' loads."""
    capacity_factor: float | None = None
    """Each expert takes at most ceil(factor * tokens * top_k / num_experts) assignments per
    forward, the rest are dropped; None: dropless."""
    decoder_sparse_step: int = 1
    """Every `decoder_sparse_step`-th block is MoE (Qwen-MoE); the others are dense."""
    mlp_only_layers: tuple[int, ...] = ()
    """Blocks that stay dense (Qwen-MoE)."""
    hidden_act: str = "silu"
    """Feed-forward gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)."""
    norm_unit_offset: bool = False
    """Every RMSNorm multiplies by (1 + weight), weights initialised to 0 (Gemma)."""
    post_norms: bool = False
    """An RMSNorm also on the attention and feed-forward outputs, before each residual add
    (`post_attention_norm`, `post_ffn_norm`; Gemma 2)."""
    scale_embeddings: bool = False
    """Embeddings times sqrt(hidden_size), rounded to the activations' dtype (Gemma)."""
    query_pre_attn_scalar: float | None = None
    """Attention scores scaled by query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5."""
    attn_logit_softcapping: float | None = None
    """Attention scores -> cap * tanh(scores / cap) before the mask (Gemma 2); runs a plain
    PyTorch attention, not the fused op; not under context parallel."""
    final_logit_softcapping: float | None = None
    """Logits -> cap * tanh(logits / cap) (Gemma 2)."""
    local_rope_theta: float | None = None
    """Blocks with the sliding window use RoPE of this base without `rope_scaling` (Gemma 3's
    rope_local_base_freq); None: every block uses `rope_theta` and `rope_scaling`."""
    rotary_dim: int | None = None
    """Channels of each head that RoPE rotates (GLM's partial rotary: head_dim / 2); the
    other pairs get a zero frequency (cos 1, sin 0). Pairs are (i, i + head_dim / 2) as
    everywhere here: a family whose checkpoints pair channels otherwise permutes q/k rows
    in its adapter. None: every channel."""
    full_attention_layers: tuple[int, ...] = ()
    """With `sliding_window`: blocks that attend to every earlier key (Gemma 2's odd
    blocks); the others slide."""
    q_lora_rank: int | None = None
    """Multi-head latent attention (`kv_lora_rank` set): width of the low-rank query
    (q_a_proj -> RMSNorm -> q_b_proj); None: one full-rank q projection (DeepSeek-V2-Lite)."""
    kv_lora_rank: int | None = None
    """Width of the compressed key/value latent of multi-head latent attention (DeepSeek-V2/V3);
    None: ordinary attention. With it, `head_dim` is qk_nope_head_dim + qk_rope_head_dim."""
    qk_nope_head_dim: int | None = None
    """MLA: channels of each query/key head without RoPE (expanded from the latent)."""
    qk_rope_head_dim: int | None = None
    """MLA: channels of each query/key head that RoPE rotates (the key's are one head shared
    by all heads)."""
    v_head_dim: int | None = None
    """MLA: channels of each value head (may differ from head_dim)."""
    rope_interleaved: bool = False
    """RoPE rotates interleaved channel pairs (2i, 2i + 1) instead of (i, i + dim / 2):
    DeepSeek-V3's `rope_interleave`; only with MLA."""
    num_expert_groups: int = 1
    """Group-limited routing (DeepSeek-V3's n_group): experts form this many groups and each
    token chooses experts only from its `topk_expert_groups` best groups (a group's score:
    the sum of its two best biased scores). 1: no grouping. Sigmoid routers only."""
    topk_expert_groups: int = 1
    """Groups each token may route to (DeepSeek-V3's topk_group)."""
    expert_group_score: str = "top2_sum"
    """How group-limited routing scores a group: "top2_sum" (DeepSeek-V3: the sum of its two
    best biased sigmoid scores) or "max" (DeepSeek-V2's group_limited_greedy: its best
    score; softmax routers too)."""
    routed_scaling_factor: float = 1.0
    """Routing weights times this after the optional renormalisation (DeepSeek-V3: 2.5)."""
    shared_expert_gated: bool = True
    """The shared expert's output passes a sigmoid gate (Qwen2-MoE); False: added as is
    (DeepSeek's shared experts)."""
    num_nextn_predict_layers: int = 0
    """Multi-token prediction modules after the decoder (DeepSeek-V3: 1): module k predicts
    token t + 1 + k from the main model's hidden state and the embedding of token t + k."""
    mtp_loss_scale: float = 0.1
    """Weight of the mean multi-token-prediction loss over modules in the training loss."""
    attention_sinks: bool = False
    """A learned logit per query head in every row's softmax denominator (gpt-oss's
    `self_attn.sinks`): a key whose value is 0, so a row may attend to nothing."""
    attention_out_bias: bool = False
    """A bias on the attention's output projection too (gpt-oss's `attention_bias` biases
    q, k, v and o; `qkv_bias` the first three)."""
    router_bias: bool = False
    """The router's logits have a learned bias (gpt-oss)."""
    expert_bias: bool = False
    """Every routed expert's projections have biases (gpt-oss)."""
    swiglu_limit: float | None = None
    """gpt-oss's clamped expert activation: gate clamped above at the limit, up to
    +-limit, out = (up + 1) * gate * sigmoid(swiglu_alpha * gate); None: SwiGLU."""
    swiglu_alpha: float = 1.702
    """The sigmoid gain of the clamped activation (only with `swiglu_limit`)."""
    attention_output_gate: bool = False
    """Qwen3-Next's gated attention: wq also gives a gate per head channel (rows [q, gate]
    per head) and the attention output is multiplied by sigmoid(gate) before wo."""
    linear_attention_layers: tuple[int, ...] = ()
    """Blocks whose token mixer is gated DeltaNet linear attention (`common.gated_deltanet`,
    Qwen3-Next's `linear_attention` layer_types) instead of softmax attention."""
    linear_num_key_heads: int | None = None
    """Gated DeltaNet: query/key heads."""
    linear_num_value_heads: int | None = None
    """Gated DeltaNet: value heads (a multiple of the key heads, which they share)."""
    linear_key_head_dim: int | None = None
    """Gated DeltaNet: channels of each query/key head."""
    linear_value_head_dim: int | None = None
    """Gated DeltaNet: channels of each value head."""
    linear_conv_kernel_dim: int = 4
    """Gated DeltaNet: taps of the short causal depthwise convolution over q, k and v."""
    index_topk: int = 0
    """DeepSeek Sparse Attention (DeepSeek-V3.2, with latent attention): each query attends
    to the `index_topk` keys its lightning indexer scores highest (all of them when it sees
    no more); 0: dense attention, no indexer."""
    index_n_heads: int | None = None
    """DSA: heads of the indexer."""
    index_head_dim: int | None = None
    """DSA: channels of each indexer head (its first qk_rope_head_dim rotated, rotate-half)."""
    index_loss_scale: float = 0.0
    """DSA training: weight of the indexer's KL loss (the main attention's head-averaged
    distribution over the selected keys as the target, DeepSeek's warm-up objective); its
    gradient reaches the indexer only. It is attached to each forward's output (Megatron's
    aux-loss scaler) with the micro-batch's share of the step, so gradient accumulation does
    not change its weight. 0: the indexer is not trained."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of weights."""
    ops_impl: str = "auto"
    """Backend of the fused ops: "auto", "reference", "cpu", "cuda" or "npu"."""
    dtype: str | None = None
    """dtype the published weights are stored in ("bfloat16", ...); informational."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            check_positive_int(name, getattr(self, name))
        check_positive_int("vocab_divisible_by", self.vocab_divisible_by)
        if self.padded_vocab_size is not None and (
            not isinstance(self.padded_vocab_size, int) or self.padded_vocab_size < self.vocab_size
        ):
            raise ConfigError(
                f"padded_vocab_size={self.padded_vocab_size!r} must be an integer >= "
                f"vocab_size={self.vocab_size}"
            )
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        check_positive_int("num_kv_heads", self.num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ConfigError(
                    f"num_heads={self.num_heads} must divide hidden_size={self.hidden_size} "
                    "(or set head_dim)"
                )
            self.head_dim = self.hidden_size // self.num_heads
        check_positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        check_positive_int("max_position_embeddings", self.max_position_embeddings)
        for name in ("rope_theta", "norm_eps", "init_std"):
            if not isinstance(getattr(self, name), int | float) or getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a positive number")
        if self.sliding_window is not None:
            check_positive_int("sliding_window", self.sliding_window)
        if self.rotary_dim is not None and (
            not isinstance(self.rotary_dim, int)
            or not 0 < self.rotary_dim <= self.head_dim
            or self.rotary_dim % 2
        ):
            raise ConfigError(
                f"rotary_dim={self.rotary_dim!r} must be an even number in 2..head_dim={self.head_dim}"
            )
        if self.qk_norm_scope not in _QK_NORM_SCOPES:
            raise ConfigError(
                f"qk_norm_scope={self.qk_norm_scope!r} must be one of {_QK_NORM_SCOPES}"
            )
        if self.ops_impl not in _OPS_IMPLS:
            raise ConfigError(f"ops_impl={self.ops_impl!r} must be one of {_OPS_IMPLS}")
        if not isinstance(self.family, str) or not self.family:
            raise ConfigError(f"family={self.family!r} must be a non-empty string")
        self.rope_scaling = _normalise_rope_scaling(self.rope_scaling)
        check_families(self)

    @property
    def rope_head_dim(self) -> int:
        """Channels of a head that the RoPE tables cover: qk_rope_head_dim with latent
        attention, head_dim otherwise."""
        return self.qk_rope_head_dim if self.kv_lora_rank is not None else self.head_dim

    @property
    def num_rows(self) -> int:
        """Rows of the embedding and output projection: the padded vocabulary size."""
        return self.padded_vocab_size or self.vocab_size

    def padded_vocab(self, tp: int) -> int:
        """The rows tensor parallel `tp` pads the vocabulary to (Megatron's rule: the next
        multiple of vocab_divisible_by x tp; vocab_size itself for tp=1)."""
        if tp == 1:
            return self.vocab_size
        multiple = self.vocab_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block `layer_id` has routed experts (Qwen-MoE's sparse step rules)."""
        return (
            self.num_experts > 0
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf(cls, source: str | Path | dict[str, Any], **overrides: Any) -> TransformerConfig:
        """Read a Hugging Face config: a `config.json` path, its directory, or its dict.

        Accepts transformers v4 (`rope_theta` + `rope_scaling`, `torch_dtype`) and v5
        (`rope_parameters`, `dtype`) spellings. `overrides` set our own fields afterwards
        (e.g. `ops_impl="reference"`).

        Raises:
            ConfigError: unreadable file, unknown `model_type`, or a feature we do not build.
        """
        hf = _read_hf(source)
        text = hf.get("text_config")
        known = model_types()
        if hf.get("model_type") not in known and isinstance(text, dict) and text.get("model_type") in known:
            # a multimodal model (Qwen3.5's): its language model's config
            outer = {k: hf[k] for k in ("tie_word_embeddings",) if k in hf and k not in text}
            hf = {**text, **outer,
                  "dtype": text.get("dtype") or hf.get("dtype") or hf.get("torch_dtype")}  # fmt: skip
        family, hf_format = format_of_model_type(hf.get("model_type"))
        return cls(**{"family": family, **hf_format.read(hf), **overrides})

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` dict for transformers (v4 keys, which v5 also reads).

        Raises:
            ConfigError: the family has no Hugging Face format.
        """
        hf_format = format_of_family(self.family)
        return {
            "architectures": [hf_format.architecture],
            "model_type": hf_format.model_type,
            **hf_format.write(self),
        }


def _normalise_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Check a rope_scaling dict and fill its optional fields with transformers' defaults."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ConfigError(f"rope_scaling must be None or a dict, got {scaling!r}")
    kind = scaling.get("type")
    if kind not in ROPE_SCALING:
        raise ConfigError(
            f"rope_scaling.type={kind!r} is not supported; choose one of {sorted(ROPE_SCALING)}"
        )
    required, optional = ROPE_SCALING[kind]
    missing = sorted(required - scaling.keys())
    if missing:
        raise ConfigError(f"rope_scaling of type {kind!r} needs {', '.join(missing)}")
    unknown = sorted(scaling.keys() - required - optional.keys() - {"type"})
    if unknown:
        raise ConfigError(f"rope_scaling of type {kind!r} has unknown field(s) {unknown}")
    out = {"type": kind, **optional, **scaling}
    if not isinstance(out["factor"], int | float) or out["factor"] <= 0:
        raise ConfigError(f"rope_scaling.factor={out['factor']!r} must be a positive number")
    return out


def _read_hf(source: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(source, dict):
        return dict(source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"Hugging Face config {path} does not exist") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"Hugging Face config {path} is not valid JSON: {err}") from None
