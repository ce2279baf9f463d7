"""TransformerConfig: Hugging Face v4/v5 spellings, export, checks; the registry and flavors."""

import json

import pytest
import torch
import transformers

from mindspeed_core.errors import CheckpointError, ConfigError
from mindspeed_llm.models import (
    ModelSpec,
    TransformerConfig,
    build_model_config,
    get_model_spec,
    model_families,
    register_model,
    unregister_model,
)
from mindspeed_llm.models.common import hf_adapter
from mindspeed_llm.models.common.family import decoder_family
from mindspeed_llm.models.common.hf_config import decoder_format
from mindspeed_llm.models.hf_format import HFFormat
from mindspeed_llm.models.hf_io import read_hf_config

BASE = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def _v4(model_type="llama", rope=None, theta=500000.0, **extra):
    """transformers v4 spelling: rope_theta at the top, rope_scaling with "type", torch_dtype."""
    d = {**BASE, "model_type": model_type, "rope_theta": theta, "torch_dtype": "bfloat16"}
    d["rope_scaling"] = None if rope is None else {"type": rope[0], **rope[1]}
    return {**d, **extra}


def _v5(model_type="llama", rope=None, theta=500000.0, **extra):
    """transformers v5 spelling: everything in rope_parameters with "rope_type", dtype."""
    kind, fields = rope or ("default", {})
    d = {**BASE, "model_type": model_type, "dtype": "bfloat16"}
    d["rope_parameters"] = {"rope_type": kind, "rope_theta": theta, **fields}
    return {**d, **extra}


ROPES = {
    "default": None,
    "linear": ("linear", {"factor": 2.0}),
    "llama3": ("llama3", {**LLAMA3, "original_max_position_embeddings": 64}),
    "yarn": ("yarn", {"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16}),
}


@pytest.mark.parametrize("rope", list(ROPES))
def test_v4_and_v5_spellings_give_the_same_config(rope):
    v4 = TransformerConfig.from_hf(_v4(rope=ROPES[rope]))
    v5 = TransformerConfig.from_hf(_v5(rope=ROPES[rope]))
    assert v4 == v5
    assert v4.rope_theta == 500000.0 and v4.dtype == "bfloat16" and v4.num_kv_heads == 2
    assert (v4.rope_scaling or {}).get("type") == (None if rope == "default" else rope)
    # and the same as transformers itself makes of either spelling
    for spelling in (_v4, _v5):
        hf = transformers.LlamaConfig(**spelling(rope=ROPES[rope]))
        assert TransformerConfig.from_hf(hf.to_dict()) == v4


def test_defaults_filled_like_transformers():
    yarn = TransformerConfig.from_hf(_v5(rope=("yarn", {"factor": 4.0}))).rope_scaling
    assert yarn["original_max_position_embeddings"] == 256  # max_position_embeddings
    assert (yarn["beta_fast"], yarn["beta_slow"], yarn["truncate"]) == (32.0, 1.0, True)
    llama3 = TransformerConfig.from_hf(_v4(rope=("llama3", LLAMA3))).rope_scaling
    assert llama3["original_max_position_embeddings"] == 256


def test_from_hf_reads_a_file_or_its_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_v4("qwen2")))
    by_dir = TransformerConfig.from_hf(tmp_path)
    assert by_dir == TransformerConfig.from_hf(tmp_path / "config.json")
    assert by_dir.family == "qwen2" and by_dir.qkv_bias
    with pytest.raises(ConfigError, match="does not exist"):
        TransformerConfig.from_hf(tmp_path / "nope")


@pytest.mark.parametrize(
    ("model_type", "extra", "expected"),
    [
        ("mistral", {"sliding_window": 4096}, 4096),
        ("mistral", {"sliding_window": None}, None),
        ("qwen2", {"sliding_window": 4096, "use_sliding_window": False}, None),
        ("qwen2", {"sliding_window": 32, "use_sliding_window": True, "max_window_layers": 0}, 32),
        ("qwen3", {"sliding_window": 32, "use_sliding_window": True, "max_window_layers": 2}, None),
    ],
)
def test_sliding_window_from_hf(model_type, extra, expected):
    assert TransformerConfig.from_hf(_v4(model_type, **extra)).sliding_window == expected


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_to_hf_dict_round_trips_through_transformers(family):
    ours = build_model_config(
        family,
        flavor="debug",
        rope_scaling={"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64},
    )
    cls = transformers.AutoConfig.for_model(**ours.to_hf_dict()).__class__
    hf = cls(**ours.to_hf_dict())
    assert TransformerConfig.from_hf(hf.to_dict()) == ours


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_kv_heads": 3}, "num_kv_heads=3 must divide num_heads=4"),
        ({"num_heads": 3, "num_kv_heads": 1}, "num_heads=3 must divide hidden_size=64"),
        ({"head_dim": 15}, "head_dim=15 must be even"),
        ({"vocab_size": 0}, "vocab_size=0"),
        ({"ops_impl": "gpu"}, "ops_impl='gpu'"),
        ({"sliding_window": -1}, "sliding_window=-1"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.type='dynamic'"),
        ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "needs high_freq_factor"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0, "beta": 1}}, "unknown field"),
    ],
)
def test_config_errors_name_the_field(changes, field):
    fields = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128}
    fields |= {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
    with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace(".", r"\.")):
        TransformerConfig(**{**fields, **changes})


@pytest.mark.parametrize(
    ("hf", "message"),
    [
        (
            _v4("gpt2"),
            "model_type='gpt2' is not supported; known: deepseek_v2, deepseek_v3, deepseek_v32, gemma2, gemma3_text, glm, glm4, glm4_moe, gpt_oss, internlm2, internlm3, llama, minimax_m2, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3, qwen3_5_moe_text, qwen3_5_text, qwen3_moe, qwen3_next",
        ),
        (_v4(num_key_value_heads=3), "num_kv_heads=3 must divide num_heads=4"),
        (_v4(hidden_act="gelu"), "hidden_act='gelu'"),
        (_v4(attention_bias=True), "attention_bias"),
        (_v4(rope=("dynamic", {"factor": 2.0})), "rope type 'dynamic'"),
        (
            _v4("qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=1),
            "some layers only",
        ),
    ],
)
def test_from_hf_refuses_what_we_do_not_build(hf, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        TransformerConfig.from_hf(hf)


def test_registry():
    assert model_families() == [
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "gemma2",
        "gemma3",
        "glm",
        "glm4",
        "glm4_moe",
        "gpt_oss",
        "internlm2",
        "internlm3",
        "llama",
        "minimax_m2",
        "mistral",
        "mixtral",
        "phi3",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_moe",
        "qwen3_next",
    ]
    with pytest.raises(ConfigError, match="unknown model family 'gpt'; known: deepseek_v2, deepseek_v3, deepseek_v32, gemma2, gemma3, glm, glm4, glm4_moe, gpt_oss, internlm2, internlm3, llama"):
        get_model_spec("gpt")
    spec = get_model_spec("llama")
    with pytest.raises(ValueError, match="already registered"):
        register_model(ModelSpec("llama", spec.flavors, spec.build, spec.parallelize, hf_adapter))
    with pytest.raises(ConfigError, match="unknown flavor 'huge' of 'llama'; known: debug"):
        build_model_config("llama", flavor="huge")
    with pytest.raises(ConfigError, match="exactly one"):
        build_model_config("llama")
    with pytest.raises(ConfigError, match="is a 'qwen2' model, not 'llama'"):
        build_model_config("llama", hf_config=_v4("qwen2"))
    config = build_model_config("llama", flavor="debug", ops_impl="reference")
    assert config.ops_impl == "reference"
    assert get_model_spec("llama").flavors["debug"].ops_impl == "auto"  # flavors stay untouched
    assert build_model_config("qwen3", hf_config=_v5("qwen3")).qk_norm


# Published parameter counts (billions, rounded as in the model cards' safetensors metadata).
PUBLISHED = {
    ("llama", "llama2-7b"): 6.738,
    ("llama", "llama3-8b"): 8.030,
    ("llama", "llama3.1-8b"): 8.030,
    ("qwen2", "qwen2.5-7b"): 7.616,
    ("qwen2", "qwen2.5-72b"): 72.706,
    ("qwen3", "qwen3-8b"): 8.191,
    ("mistral", "mistral-7b"): 7.242,
    ("mixtral", "mixtral-8x7b"): 46.703,
    ("qwen2_moe", "qwen1.5-moe-a2.7b"): 14.316,
    ("qwen3_moe", "qwen3-30b-a3b"): 30.532,
}


@pytest.mark.parametrize(("family", "flavor"), list(PUBLISHED))
def test_real_flavors_have_the_published_size(family, flavor):
    spec = get_model_spec(family)
    with torch.device("meta"):
        model = spec.build(spec.flavors[flavor])
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    assert billions == pytest.approx(PUBLISHED[family, flavor], abs=1e-3)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_debug_flavor_fits_tp(family):
    config = get_model_spec(family).flavors["debug"]
    assert config.vocab_size % 4 == 0 and config.num_kv_heads % 2 == 0
    assert config.hidden_size <= 64 and config.num_layers == 2


def test_adapter_reports_missing_and_unexpected_keys():
    config = build_model_config("llama", flavor="debug")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.to_hf_dict()))
    sd = dict(hf.state_dict())
    sd.pop("model.layers.1.mlp.up_proj.weight")
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    with pytest.raises(
        CheckpointError, match="missing model.layers.1.mlp.up_proj.weight; unexpected"
    ):
        hf_adapter.from_hf(sd, config)
    with pytest.raises(CheckpointError, match="missing output.weight"):
        ours = hf_adapter.from_hf(hf.state_dict(), config)
        del ours["output.weight"]
        hf_adapter.to_hf(ours, config)


def _toy_format() -> HFFormat:
    """An embedder's family whose config.json spells everything its own way."""

    def read(hf):
        return {
            "vocab_size": hf["n_vocab"],
            "hidden_size": hf["n_embd"],
            "intermediate_size": hf["n_inner"],
            "num_layers": hf["n_layer"],
            "num_heads": hf["n_head"],
            "qk_norm": hf["qk_layernorm"],
        }

    def write(config):
        return {
            "n_vocab": config.vocab_size,
            "n_embd": config.hidden_size,
            "n_inner": config.intermediate_size,
            "n_layer": config.num_layers,
            "n_head": config.num_heads,
            "qk_layernorm": config.qk_norm,
        }

    return HFFormat(model_type="toy_lm", architecture="ToyLMForCausalLM", read=read, write=write)


def test_a_user_family_brings_its_own_hugging_face_format(tmp_path):
    """Registered with its format, a new family reads and writes config.json through the
    registry alone: config.json -> TransformerConfig -> the same config.json."""
    llama = get_model_spec("llama")
    toy = {"model_type": "toy_lm", "architectures": ["ToyLMForCausalLM"], "n_vocab": 256}
    toy |= {"n_embd": 32, "n_inner": 64, "n_layer": 2, "n_head": 4, "qk_layernorm": True}
    (tmp_path / "config.json").write_text(json.dumps(toy))
    # a second family made with the built-in helper: Llama's keys under another model_type
    alike = decoder_format("llama_alike", "LlamaAlikeForCausalLM", flags={"qkv_bias": True})
    register_model(
        ModelSpec("toy", {}, llama.build, llama.parallelize, hf_adapter, hf=_toy_format())
    )
    register_model(decoder_family("llama_alike", {}, alike))
    try:
        config = build_model_config("toy", hf_config=tmp_path)
        assert (config.family, config.hidden_size, config.num_kv_heads, config.qk_norm) == (
            "toy",
            32,
            4,
            True,
        )
        assert config.to_hf_dict() == toy
        assert read_hf_config(tmp_path) == config  # the checked path of `mindspeed` commands
        with torch.device("meta"):
            assert get_model_spec("toy").build(config).layers["0"].attention.q_norm is not None
        ours = build_model_config("llama", flavor="debug")
        again = TransformerConfig.from_hf({**ours.to_hf_dict(), "model_type": "llama_alike"})
        assert again.family == "llama_alike" and again.qkv_bias
        assert again.to_hf_dict()["architectures"] == ["LlamaAlikeForCausalLM"]
        with pytest.raises(ValueError, match="model_type 'toy_lm' already belongs to 'toy'"):
            register_model(
                ModelSpec("toy2", {}, llama.build, llama.parallelize, hf_adapter, hf=_toy_format())
            )
    finally:
        unregister_model("toy")
        unregister_model("llama_alike")
    assert "toy" not in model_families()
    with pytest.raises(ConfigError, match="model_type='toy_lm' is not supported"):
        TransformerConfig.from_hf(toy)
