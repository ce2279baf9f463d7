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
    return model.to(device).eval()


def ours_from(hf_model) -> Transformer:
    config = TransformerConfig.from_hf(hf_model.config.to_dict())
    model = Transformer(config).to(hf_model.device)
    adapter = get_model_spec(config.family).hf_adapter
    model.load_state_dict(adapter.from_hf(hf_model.state_dict(), config))
    return model.eval()


def tokens(batch=2, seq=SEQ, seed=1):
    return torch.randint(
        0, TINY["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed)
    )
