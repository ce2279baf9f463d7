"""gpt-oss: attention sinks, q/k/v/o biases, alternating windows, YaRN and biased experts with
a clamped SwiGLU give transformers' logits (fp32) and greedy tokens through our KV cache; its
interleaved gate_up tensors go to and from Hugging Face bit-identically; tp=2 (+SP) and
ep=2 equal one process."""

import dataclasses

import pytest
import torch
import transformers

from mindspeed_core.errors import ConfigError
from mindspeed_core.testing import import_sibling, run_distributed
from mindspeed_llm.generation import GenerationConfig, generate
from mindspeed_llm.models import Transformer, TransformerConfig, build_model_config, get_model_spec

models_hf = import_sibling(__file__, "models_hf")
ATOL = 2e-5  # as test_models_families: our few-row CPU GEMM sums in another order

TINY = {
    **{k: v for k, v in models_hf.TINY.items() if k != "intermediate_size"},
    "intermediate_size": 32,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "router_aux_loss_coef": 0.01,
    # a low limit so that the clamps bind on these small activations
    "swiglu_limit": 0.3,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    },
}


def make_hf(**changes):
    config = transformers.GptOssConfig(**{**TINY, **changes})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # every tensor random, the sinks large enough to matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("sinks"):
                p.normal_(0, 1.0)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.08)
    return model.eval()


def test_logits_match_transformers_and_every_feature_counts():
    hf = make_hf()
    ours = models_hf.ours_from(hf)
    config = ours.config
    assert config.family == "gpt_oss" and config.full_attention_layers == (1,)
    assert config.sliding_window == 8 and config.rope_scaling["type"] == "yarn"
    ids = models_hf.tokens()
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    # Each gpt-oss feature changes the logits here, so the match above covers it.
    for change in ({"attention_sinks": False}, {"swiglu_limit": 100.0}, {"sliding_window": 64}):
        other = Transformer(dataclasses.replace(config, **change)).eval()
        state = {k: v for k, v in ours.state_dict().items() if "sinks" not in k}
        other.load_state_dict(state, strict=False)
        with torch.no_grad():
            assert (other(ids) - got).abs().max() > 1e-3, change


def test_greedy_with_kv_cache_matches_transformers():
    """32 tokens past the 8-token window: the sinks and the windowed cache in decoding."""
    hf = make_hf()
    ours = models_hf.ours_from(hf)
    prompts = models_hf.prompts((11, 3))
    config = GenerationConfig(max_new_tokens=32)
    alone = [generate(ours, [p], config)[0] for p in prompts]
    assert generate(ours, prompts, config) == alone  # left padding changes nothing
    for prompt, got in zip(prompts, alone, strict=True):
        assert got == models_hf.hf_greedy(hf, prompt)


def test_state_dict_round_trips_bit_identical_with_gate_up_interleaved():
    hf = make_hf()
    config = TransformerConfig.from_hf(hf.config.to_dict())
    adapter = get_model_spec("gpt_oss").hf_adapter
    sd = hf.state_dict()
    ours = adapter.from_hf(sd, config)
    assert ours.keys() == Transformer(config).state_dict().keys()
    gate_up = sd["model.layers.1.mlp.experts.gate_up_proj"]  # (E, hidden, 2 * intermediate)
    assert torch.equal(ours["layers.1.feed_forward.experts.w1"], gate_up[..., 0::2])
    assert torch.equal(ours["layers.1.feed_forward.experts.w3"], gate_up[..., 1::2])
    back = adapter.to_hf(ours, config)
    assert back.keys() == sd.keys()
    for name, tensor in sd.items():
        assert torch.equal(back[name], tensor), name


def test_config_reads_v4_and_v5_spellings_and_refuses_what_we_lack():
    v5 = make_hf().config.to_dict()
    config = TransformerConfig.from_hf(v5)
    again = TransformerConfig.from_hf(config.to_hf_dict())
    assert again == config
    # OpenAI's published config.json (v4): rope_scaling + rope_theta, experts_per_token, no
    # layer_types (even layers slide) and no swiglu_alpha.
    v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "layer_types", "swiglu_alpha",
                                                     "num_experts_per_tok")}  # fmt: skip
    v4.update(rope_theta=150000.0, experts_per_token=2,
              rope_scaling={k: v for k, v in TINY["rope_parameters"].items() if k != "rope_theta"})  # fmt: skip
    assert TransformerConfig.from_hf(v4) == config
    with pytest.raises(ConfigError, match="quant_method='mxfp4'.*dequantized"):
        TransformerConfig.from_hf({**v5, "quantization_config": {"quant_method": "mxfp4"}})
    with pytest.raises(ConfigError, match="attention_bias=false"):
        TransformerConfig.from_hf({**v5, "attention_bias": False})
    with pytest.raises(ConfigError, match="layer_types"):
        TransformerConfig.from_hf({**v5, "layer_types": ["sliding_attention", "chunked"]})
    debug = build_model_config("gpt_oss", "debug")
    with pytest.raises(ConfigError, match="swiglu_limit=0"):
        dataclasses.replace(debug, swiglu_limit=0)
    with pytest.raises(ConfigError, match="router_bias needs routed experts"):
        dataclasses.replace(debug, num_experts=0)
    published = build_model_config("gpt_oss", "gpt-oss-120b")
    assert published.num_experts == 128 and published.full_attention_layers[-1] == 35


TP_CASES = {"gpt_oss_tp2_sp": ("gpt_oss", {}, {"sequence_parallel": True})}


def _tp():
    families = import_sibling(__file__, "test_models_families")
    family, changes, options = TP_CASES["gpt_oss_tp2_sp"]
    model = get_model_spec(family).build(build_model_config(family, "debug"))
    assert model.layers["0"].attention.sinks.shape == (4,)
    result = families._step(family, changes, options)
    return result


@pytest.mark.distributed
def test_tp2_sp_matches_one_process():
    """Sinks sharded by head, the o bias after the row-parallel reduction."""
    families = import_sibling(__file__, "test_models_families")
    ranks = run_distributed(_tp, 2, timeout=300)
    ref = families._step("gpt_oss", {})
    assert any("sinks" in k for k in ref) and any("experts.b1" in k for k in ref)
    for result in ranks:
        assert result.keys() == ref.keys()
        for key, value in ref.items():
            torch.testing.assert_close(result[key], value, atol=ATOL, rtol=0, msg=key)


@pytest.mark.slow
@pytest.mark.distributed
def test_ep2_over_dp_shard2_matches_one_process():
    """Biased experts sharded over ep: three AdamW steps give one process's losses,
    gradients and weights (test_models_moe_parallel's comparison)."""
    moe_parallel = import_sibling(__file__, "test_models_moe_parallel")
    results = run_distributed(
        moe_parallel._compare, 2, 2, {"dp_shard": 2, "ep": 2}, "gpt_oss", {}, timeout=300
    )
    assert results[0] == results[1]
