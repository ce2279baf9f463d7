"""GLM-4-9B-chat (`glm`), InternLM2 and DeepSeek-V2 beyond the shared parity tests.

GLM's logits, greedy decoding and HF round trip run with the other families in
test_models_families.py (models_hf.FAMILY_CASES). InternLM2 has no transformers class: its
oracle is transformers' Llama, given the same random weights unfused from InternLM2's
grouped `wqkv` by a mapping written here from the published layout. DeepSeek-V2 is
compared with transformers' DeepseekV2ForCausalLM (softmax routing, greedy and
group-limited, scaled weights)."""

import dataclasses

import pytest
import torch
import transformers

from mindspeed_core.errors import CheckpointError, ConfigError
from mindspeed_core.parallel import ParallelConfig
from mindspeed_core.testing import import_sibling, run_distributed
from mindspeed_llm.generation import GenerationConfig, generate
from mindspeed_llm.models import Transformer, TransformerConfig, build_model_config, get_model_spec
from mindspeed_llm.models.common.layout import LayoutError, check_layout

models_hf = import_sibling(__file__, "models_hf")
INTERNLM2, internlm2_state_dict, llama_oracle = (
    models_hf.INTERNLM2,
    models_hf.internlm2_state_dict,
    models_hf.llama_oracle,
)
make_hf, ours_from, tokens, SEQ = (
    models_hf.make_hf,
    models_hf.ours_from,
    models_hf.tokens,
    models_hf.SEQ,
)
ATOL = 1e-5
VOCAB = 512


def _greedy_equals(ours, hf, new_tokens=16):
    """Our KV-cache greedy tokens equal transformers' generate, and a left-padded batch
    gives the one-by-one tokens."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (11, 3)]
    config = GenerationConfig(max_new_tokens=new_tokens)
    alone = [generate(ours, [p], config)[0] for p in prompts]
    assert generate(ours, prompts, config) == alone
    for prompt, got in zip(prompts, alone, strict=True):
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert got == out[0, len(prompt) :].tolist()


# -- GLM (GLM-4-9B-chat) ------------------------------------------------------------------


def test_glm_reads_v4_and_v5_spellings_and_refuses_what_it_lacks():
    v5 = make_hf("glm").config.to_dict()
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4.update(rope_theta=10000.0, partial_rotary_factor=0.5)
    config = TransformerConfig.from_hf(v5)
    assert config.family == "glm" and config.rotary_dim == 8 and config.qkv_bias
    assert not config.post_norms  # GLM-4-9B-chat has none, unlike the 0414 glm4
    assert TransformerConfig.from_hf(v4) == config
    assert TransformerConfig.from_hf(config.to_hf_dict()) == config
    published = build_model_config("glm", "glm-4-9b-chat")
    assert TransformerConfig.from_hf(published.to_hf_dict()) == published
    # transformers' GlmConfig defaults are THUDM/glm-4-9b-chat's (its docstring's checkpoint)
    defaults = TransformerConfig.from_hf(transformers.GlmConfig().to_dict())
    assert defaults == dataclasses.replace(published, dtype=None)
    for key, value, match in (
        ("attention_bias", False, "attention_bias=false"),
        ("hidden_act", "gelu", "hidden_act='gelu'"),
        ("mlp_bias", True, "mlp_bias"),
    ):
        with pytest.raises(ConfigError, match=match):
            TransformerConfig.from_hf({**v5, key: value})


def test_glm_weights_are_glm4_rows_without_post_norms():
    """q rows are permuted (partial interleaved RoPE), gate/up split in order, and a GLM
    checkpoint read as glm4 is refused for its missing post norms."""
    hf = make_hf("glm")
    ours = ours_from(hf)
    layer = hf.model.layers[1]
    ffn = ours.layers["1"].feed_forward
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([ffn.w1.weight, ffn.w3.weight]))
    q = ours.layers["1"].attention.wq.weight
    assert not torch.equal(q, layer.self_attn.q_proj.weight)
    assert torch.equal(q.sort(dim=0).values, layer.self_attn.q_proj.weight.sort(dim=0).values)
    as_glm4 = TransformerConfig.from_hf({**hf.config.to_dict(), "model_type": "glm4"})
    with pytest.raises(CheckpointError, match="missing model.layers.0.post_"):
        get_model_spec("glm4").hf_adapter.from_hf(hf.state_dict(), as_glm4)


# -- InternLM2 ----------------------------------------------------------------------------


def internlm2_ours(config: dict, sd: dict[str, torch.Tensor]) -> Transformer:
    ours_config = TransformerConfig.from_hf(config)
    model = Transformer(ours_config)
    model.load_state_dict(get_model_spec("internlm2").hf_adapter.from_hf(sd, ours_config))
    return model.eval()


def test_internlm2_logits_and_greedy_decoding_match_llama_on_the_unfused_weights():
    sd = internlm2_state_dict(INTERNLM2)
    ours, oracle = internlm2_ours(INTERNLM2, sd), llama_oracle(INTERNLM2, sd)
    assert ours.config.family == "internlm2" and ours.config.num_kv_heads == 2
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), oracle(ids).logits, atol=ATOL, rtol=0)
    _greedy_equals(ours, oracle)


def test_internlm2_wqkv_layout_matters_and_round_trips_bit_identical():
    """Reading wqkv as plain [q; k; v] (Phi-3's layout) gives other logits, so the parity
    above checks the grouping; ours -> InternLM2 -> ours is exact."""
    sd = internlm2_state_dict(INTERNLM2)
    config = TransformerConfig.from_hf(INTERNLM2)
    adapter = get_model_spec("internlm2").hf_adapter
    ours = adapter.from_hf(sd, config)
    assert ours.keys() == Transformer(config).state_dict().keys()
    back = adapter.to_hf(ours, config)
    assert back.keys() == sd.keys()
    for name, tensor in sd.items():
        assert torch.equal(back[name], tensor), name
    plain = dict(ours)
    for i in range(2):
        q, k, v = sd[f"model.layers.{i}.attention.wqkv.weight"].split([64, 16, 16])
        plain.update(
            {f"layers.{i}.attention.w{n}.weight": t for n, t in zip("qkv", (q, k, v), strict=True)}
        )
    model = Transformer(config)
    model.load_state_dict(plain)
    ids = tokens()
    with torch.no_grad():
        assert not torch.allclose(model.eval()(ids), internlm2_ours(INTERNLM2, sd)(ids), atol=1e-3)
    bad = {
        **sd,
        "model.layers.0.attention.wqkv.weight": sd["model.layers.0.attention.wqkv.weight"][:-1],
    }
    with pytest.raises(CheckpointError, match="wqkv.weight has shape"):
        adapter.from_hf(bad, config)


def test_internlm2_config_reads_its_spelling_and_refuses_dynamic_rope_and_bias():
    config = TransformerConfig.from_hf(INTERNLM2)
    assert config.rope_theta == 1e6 and config.head_dim == 8 and not config.qkv_bias
    written = config.to_hf_dict()
    assert written["bias"] is False and "head_dim" not in written
    assert TransformerConfig.from_hf(written) == config
    published = build_model_config("internlm2", "internlm2_5-7b")
    assert TransformerConfig.from_hf(published.to_hf_dict()) == published
    with pytest.raises(ConfigError, match="bias=true"):
        TransformerConfig.from_hf({**INTERNLM2, "bias": True})
    with pytest.raises(ConfigError, match="'dynamic' is not supported"):
        TransformerConfig.from_hf({**INTERNLM2, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ConfigError, match="head_dim=16 must be hidden_size / num_heads"):
        dataclasses.replace(config, head_dim=16).to_hf_dict()


# -- DeepSeek-V2 --------------------------------------------------------------------------

V2_TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 2.0,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
}
V2_CASES = {
    # V2-Lite: full-rank q, greedy top-k over all experts
    "lite-greedy": {"q_lora_rank": None, "topk_method": "greedy"},
    # V2: low-rank q, routing limited to the 2 of 4 groups with the best expert (top-3, as
    # a limit to top_k or more groups with the best expert would change nothing)
    "group-limited": {
        "q_lora_rank": 32,
        "num_experts_per_tok": 3,
        "topk_method": "group_limited_greedy",
        "n_group": 4,
        "topk_group": 2,
    },
    "yarn": {
        "q_lora_rank": None,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    },
}


def make_v2(case: str, **changes) -> transformers.DeepseekV2ForCausalLM:
    config = transformers.DeepseekV2Config(**{**V2_TINY, **V2_CASES[case], **changes})
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(config)
    with torch.no_grad():  # HF initialises norms to 1
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.08)
    return model.eval()


def v2_ours(hf_model) -> Transformer:
    config = TransformerConfig.from_hf(hf_model.config.to_dict())
    model = get_model_spec(config.family).build(config)
    model.load_state_dict(
        get_model_spec(config.family).hf_adapter.from_hf(hf_model.state_dict(), config)
    )
    return model.eval()


@pytest.mark.parametrize("case", list(V2_CASES))
def test_deepseek_v2_logits_match_transformers(case):
    hf = make_v2(case)
    ours = v2_ours(hf)
    config = ours.config
    assert config.family == "deepseek_v2" and config.router_score == "softmax"
    assert config.mlp_only_layers == (0,) and config.shared_expert_intermediate_size == 64
    assert config.num_expert_groups == (4 if case == "group-limited" else 1)
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=ATOL, rtol=0)


def test_deepseek_v2_group_limit_and_scaling_change_the_routing():
    """Without either the logits move, so the equality above is no accident."""
    hf = make_v2("group-limited")
    ids = tokens()
    with torch.no_grad():
        ref = v2_ours(hf)(ids)
        for change in (
            {"num_expert_groups": 1, "topk_expert_groups": 1},
            {"expert_group_score": "top2_sum", "router_score": "sigmoid"},
            {"routed_scaling_factor": 1.0},
        ):
            model = Transformer(dataclasses.replace(v2_ours(hf).config, **change))
            state = v2_ours(hf).state_dict()
            model.load_state_dict(state, strict=False)  # a sigmoid router adds its bias
            assert not torch.allclose(model.eval()(ids), ref, atol=1e-3), change


def test_deepseek_v2_greedy_with_kv_cache_matches_transformers():
    hf = make_v2("group-limited")
    _greedy_equals(v2_ours(hf), hf, new_tokens=12)


def test_deepseek_v2_state_dict_round_trips():
    """transformers' in-memory names -> ours -> checkpoint names (per expert, no
    e_score_correction_bias) -> ours, unchanged."""
    hf = make_v2("lite-greedy")
    config = TransformerConfig.from_hf(hf.config.to_dict())
    adapter = get_model_spec("deepseek_v2").hf_adapter
    ours = adapter.from_hf(hf.state_dict(), config)
    assert ours.keys() == Transformer(config).state_dict().keys()
    ckpt = adapter.to_hf(ours, config)
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in ckpt
    assert not any("e_score_correction_bias" in k for k in ckpt)
    back = adapter.from_hf(ckpt, config)
    for name, tensor in ours.items():
        assert torch.equal(back[name], tensor), name


def test_deepseek_v2_config_round_trips_and_reads_v4_spelling():
    hf = make_v2("group-limited")
    config = TransformerConfig.from_hf(hf.config.to_dict())
    written = config.to_hf_dict()
    assert written["topk_method"] == "group_limited_greedy" and written["scoring_func"] == "softmax"
    assert "rope_parameters" not in written and TransformerConfig.from_hf(written) == config
    rebuilt = transformers.DeepseekV2Config(**written)
    assert rebuilt.n_group == 4 and rebuilt.topk_method == "group_limited_greedy"
    greedy = {**written, "topk_method": "greedy"}  # n_group is then ignored, as transformers does
    assert TransformerConfig.from_hf(greedy).num_expert_groups == 1
    for flavor in ("debug", "deepseek-v2-lite"):
        published = build_model_config("deepseek_v2", flavor)
        assert TransformerConfig.from_hf(published.to_hf_dict()) == published


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("scoring_func", "sigmoid"),
        ("topk_method", "noaux_tc"),
        ("norm_topk_prob", True),
        ("moe_layer_freq", 2),
        ("attention_bias", True),
        ("quantization_config", {"quant_method": "fp8"}),
    ],
)
def test_deepseek_v2_refuses_what_we_do_not_build(key, value):
    written = build_model_config("deepseek_v2", "debug").to_hf_dict()
    with pytest.raises(ConfigError, match=key):
        TransformerConfig.from_hf({**written, key: value})


def test_deepseek_v2_layouts_and_group_score():
    """tp and cp are checked by `test_models_moe_layouts.py` (latent attention + MoE); a tp
    that does not divide the heads is refused."""
    debug = build_model_config("deepseek_v2", "debug")
    check_layout(debug, ParallelConfig(tp=2, cp=2))
    with pytest.raises(LayoutError, match="latent attention splits its heads"):
        check_layout(debug, ParallelConfig(tp=3))
    with pytest.raises(ConfigError, match="expert_group_score"):
        dataclasses.replace(debug, expert_group_score="mean")
    with pytest.raises(ConfigError, match="num_nextn_predict_layers=1 cannot be written"):
        dataclasses.replace(debug, num_nextn_predict_layers=1).to_hf_dict()


@pytest.mark.slow
@pytest.mark.distributed
def test_deepseek_v2_ep2_over_dp_shard2_matches_one_process():
    """Softmax group-limited routing under expert parallel: three AdamW steps give one
    process's losses, gradients and weights (test_models_moe_parallel's comparison; every
    block MoE so that block 0's experts are the sharded ones it checks)."""
    moe_parallel = import_sibling(__file__, "test_models_moe_parallel")
    changes = {"mlp_only_layers": ()}
    degrees = {"dp_shard": 2, "ep": 2}
    results = run_distributed(
        moe_parallel._compare, 2, 2, degrees, "deepseek_v2", changes, timeout=300
    )
    assert results[0] == results[1]
