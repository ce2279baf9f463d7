"""Tiny Hugging Face models with every tensor randomised, and ours built from them."""

import torch
import transformers

from mindspeed_llm.models import Transformer, TransformerConfig, get_model_spec

SEQ = 24
TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
CASES = {
    "llama": ("LlamaConfig", {}),
    "llama-linear": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-llama3": (
        "LlamaConfig",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-yarn": (
        "LlamaConfig",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "qwen2": ("Qwen2Config", {}),
    "qwen2-tied": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "mistral-window": ("MistralConfig", {"sliding_window": 8}),
}

GLM4_MOE = {
    "head_dim": 32,
    "partial_rotary_factor": 0.5,
    "attention_bias": True,
    "use_qk_norm": True,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 0,  # transformers builds no MTP layers
    "pad_token_id": 0,
    "eos_token_id": 2,
}
FAMILY_CASES = {
    "phi3": ("Phi3Config", {"sliding_window": 8, "pad_token_id": 0, "eos_token_id": 2}),
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            # small caps so that capping changes the answer
            "attn_logit_softcapping": 0.5,
            "final_logit_softcapping": 1.5,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
        },
    ),
    # partial rotary (a quarter of the head here, half in the published models), q/k/v biases
    "glm4": (
        "Glm4Config",
        {"head_dim": 32, "partial_rotary_factor": 0.25, "pad_token_id": 0, "eos_token_id": 2},
    ),
    "internlm3": ("InternLM3Config", {"head_dim": 16, "rope_theta": 5e7}),
    # GLM-4-9B-chat's form: glm4's partial interleaved RoPE (half here) without post norms
    "glm": (
        "GlmConfig",
        {"head_dim": 16, "partial_rotary_factor": 0.5, "pad_token_id": 0, "eos_token_id": 2},
    ),
    # GLM-4.5's form: rotate-half RoPE on half of each head, q/k/v biases, per-head qk-norm,
    # a dense first block, 8 sigmoid-routed experts in 4 groups (2 chosen) plus a shared one
    "glm4_moe": ("Glm4MoeConfig", GLM4_MOE),
    # GLM-4.5-Air's form: no qk-norm, one expert group, routed_scaling_factor 1
    "glm4_moe-air": (
        "Glm4MoeConfig",
        {**GLM4_MOE, "use_qk_norm": False, "n_group": 1, "topk_group": 1,
         "routed_scaling_factor": 1.0},
    ),  # fmt: skip
    # MiniMax-M2's form: one q and one k RMSNorm over all heads, rotate-half RoPE on half of
    # each head (its published `rotary_dim`), 8 sigmoid-routed experts in every block
    "minimax_m2": (
        "MiniMaxM2Config",
        {"head_dim": 32, "rotary_dim": 16, "intermediate_size": 32, "num_local_experts": 8,
         "num_experts_per_tok": 2, "pad_token_id": 0, "eos_token_id": 2},
    ),  # fmt: skip
}
"""Families whose Hugging Face names are not the dense adapter's (tested in
test_models_families.py)."""


def make_hf(case: str, device="cpu", **changes):
    cls_name, extra = {**CASES, **FAMILY_CASES}[case]
    config = getattr(transformers, cls_name)(**{**TINY, **extra, **changes})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: make every tensor count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.08)
        for name, b in model.named_buffers():  # sigmoid routers' balancing bias
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    return model.to(device).eval()


def ours_from(hf_model) -> Transformer:
    config = TransformerConfig.from_hf(hf_model.config.to_dict())
    model = Transformer(config).to(hf_model.device)
    adapter = get_model_spec(config.family).hf_adapter
    model.load_state_dict(adapter.from_hf(hf_model.state_dict(), config))
    return model.eval()


def prompts(lengths, seed=3) -> list[list[int]]:
    """Random token prompts of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(hf_model, prompt: list[int], new: int = 32) -> list[int]:
    """transformers' greedy continuation of `prompt`: exactly `new` tokens, no EOS stop."""
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                            pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def tokens(batch=2, seq=SEQ, seed=1):
    return torch.randint(
        0, TINY["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed)
    )


# -- InternLM2 (remote code only: no transformers class) ---------------------------------

INTERNLM2 = {
    "model_type": "internlm2",
    "architectures": ["InternLM2ForCausalLM"],
    "vocab_size": TINY["vocab_size"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "bias": False,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attn_implementation": "eager",
    "torch_dtype": "float32",
}
"""A tiny config.json as InternLM2.5's remote code spells it (4 query heads per kv head)."""


def internlm2_state_dict(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under InternLM2's checkpoint names (norms near 1)."""
    gen = torch.Generator().manual_seed(seed)
    h, ffn = config["hidden_size"], config["intermediate_size"]
    d = h // config["num_attention_heads"]

    def w(*shape, norm=False):
        if norm:
            return torch.rand(*shape, generator=gen) + 0.5
        return torch.randn(*shape, generator=gen) * 0.08

    rows = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * d
    sd = {
        "model.tok_embeddings.weight": w(TINY["vocab_size"], h),
        "model.norm.weight": w(h, norm=True),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({
            p + "attention_norm.weight": w(h, norm=True),
            p + "attention.wqkv.weight": w(rows, h),
            p + "attention.wo.weight": w(h, config["num_attention_heads"] * d),
            p + "ffn_norm.weight": w(h, norm=True),
            p + "feed_forward.w1.weight": w(ffn, h),
            p + "feed_forward.w3.weight": w(ffn, h),
            p + "feed_forward.w2.weight": w(h, ffn),
        })  # fmt: skip
    sd["output.weight"] = w(TINY["vocab_size"], h)
    return sd


def llama_oracle(config: dict, sd: dict[str, torch.Tensor]) -> transformers.LlamaForCausalLM:
    """transformers' Llama holding InternLM2 weights: wqkv unfused by the published layout
    (rows per kv head g: its q heads, then k_g, then v_g), a loop over row blocks."""
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d, per = config["hidden_size"] // heads, heads // kv
    llama = transformers.LlamaConfig(
        **{k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                  "num_hidden_layers", "num_attention_heads",
                                  "num_key_value_heads", "max_position_embeddings",
                                  "rms_norm_eps", "rope_theta")},
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(llama, attn_implementation="eager")
    out = {"model.embed_tokens.weight": sd["model.tok_embeddings.weight"],
           "model.norm.weight": sd["model.norm.weight"], "lm_head.weight": sd["output.weight"]}  # fmt: skip
    for i in range(config["num_hidden_layers"]):
        src, dst = f"model.layers.{i}.", f"model.layers.{i}."
        wqkv, q, k, v = sd[src + "attention.wqkv.weight"], [], [], []
        for g in range(kv):
            start = g * (per + 2) * d
            q.append(wqkv[start : start + per * d])
            k.append(wqkv[start + per * d : start + (per + 1) * d])
            v.append(wqkv[start + (per + 1) * d : start + (per + 2) * d])
        out.update({
            dst + "self_attn.q_proj.weight": torch.cat(q),
            dst + "self_attn.k_proj.weight": torch.cat(k),
            dst + "self_attn.v_proj.weight": torch.cat(v),
            dst + "self_attn.o_proj.weight": sd[src + "attention.wo.weight"],
            dst + "input_layernorm.weight": sd[src + "attention_norm.weight"],
            dst + "post_attention_layernorm.weight": sd[src + "ffn_norm.weight"],
            dst + "mlp.gate_proj.weight": sd[src + "feed_forward.w1.weight"],
            dst + "mlp.up_proj.weight": sd[src + "feed_forward.w3.weight"],
            dst + "mlp.down_proj.weight": sd[src + "feed_forward.w2.weight"],
        })  # fmt: skip
    model.load_state_dict(out, strict=False)  # rotary buffers are recomputed
    return model.eval()
