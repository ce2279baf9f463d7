"""Qwen3-Next: gated DeltaNet blocks (short convolution, gated delta rule, gated RMSNorm)
beside gated softmax attention with partial RoPE, zero-centred norms and a gated shared
expert give transformers' logits (fp32) and greedy tokens through our cache (recurrent
states included, left padding too); packed documents equal separate rows; the weights go to
and from Hugging Face bit-identically; tp=2 (+SP), ep=2 and cp=2 (the state passed along the
zig-zag chunks) equal one process."""

import dataclasses

import pytest
import torch
import transformers

from mindspeed_core.errors import ConfigError
from mindspeed_core.parallel import ParallelConfig
from mindspeed_core.testing import import_sibling, run_distributed
from mindspeed_llm.generation import GenerationConfig, generate
from mindspeed_llm.models import Transformer, TransformerConfig, build_model_config, get_model_spec
from mindspeed_llm.models.common.layout import LayoutError, check_layout

models_hf = import_sibling(__file__, "models_hf")
ATOL = 2e-5  # as test_models_families: our few-row CPU GEMM sums in another order

TINY = {
    **models_hf.TINY,
    "num_hidden_layers": 4,
    "head_dim": 32,
    "partial_rotary_factor": 0.25,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "mlp_only_layers": [2],  # one dense block too
}


def make_hf(**changes):
    config = transformers.Qwen3NextConfig(**{**TINY, **changes})
    return _random_hf(config)


def _random_hf(config):
    """transformers' model of `config` with every tensor random: zero-centred norms near 0,
    the gated one near 1."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "linear_attn.norm" in name:
                p.uniform_(0.5, 1.5)
            elif "norm" in name:
                p.uniform_(-0.5, 0.5)
            elif name.endswith(("A_log", "dt_bias")):
                p.uniform_(-1.0, 1.0)
            else:
                p.normal_(0, 0.08)
    return model.eval()


def test_logits_match_transformers():
    hf = make_hf()
    ours = models_hf.ours_from(hf)
    config = ours.config
    assert config.linear_attention_layers == (0, 2) and config.rotary_dim == 8
    assert not config.is_moe_layer(2) and config.is_moe_layer(3)
    ids = models_hf.tokens()
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_packed_documents_equal_separate_rows():
    """The convolution and the recurrent state restart at every document of a packed row."""
    ours = models_hf.ours_from(make_hf())
    ids = models_hf.tokens(batch=1, seq=30)
    cu = torch.tensor([0, 7, 19, 30], dtype=torch.int32)
    with torch.no_grad():
        packed = ours(ids, cu_seqlens=cu)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            alone = ours(ids[:, a:b])
            torch.testing.assert_close(packed[:, a:b], alone, atol=ATOL, rtol=0)
    # and the gradients flow through both mixers
    ours.train()
    ours(ids, cu_seqlens=cu).logsumexp(-1).mean().backward()
    block = ours.layers["0"].attention
    assert block.conv_weight.grad.abs().sum() > 0 and block.A_log.grad.abs().sum() > 0


def test_greedy_with_cache_matches_transformers():
    """32 tokens decoded with recurrent states in our cache; a left-padded batch gives the
    one-by-one tokens (padding leaves the states at zero)."""
    hf = make_hf()
    ours = models_hf.ours_from(hf)
    prompts = models_hf.prompts((11, 3))
    config = GenerationConfig(max_new_tokens=32)
    alone = [generate(ours, [p], config)[0] for p in prompts]
    assert generate(ours, prompts, config) == alone
    for prompt, got in zip(prompts, alone, strict=True):
        assert got == models_hf.hf_greedy(hf, prompt)


def test_state_dict_round_trips_bit_identical():
    """transformers' in-memory tensors (fused experts) -> ours -> Hugging Face checkpoint names
    (per-expert, as save_pretrained writes them; the file round trip is in test_convert.py)
    -> ours again, bit for bit."""
    hf = make_hf()
    config = TransformerConfig.from_hf(hf.config.to_dict())
    adapter = get_model_spec("qwen3_next").hf_adapter
    sd = hf.state_dict()
    ours = adapter.from_hf({**sd, "mtp.fc.weight": torch.zeros(2, 2)}, config)  # mtp skipped
    assert ours.keys() == Transformer(config).state_dict().keys()
    back = adapter.to_hf(ours, config)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in back
    for name in ("model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.1.self_attn.q_proj.weight",
                 "model.layers.3.self_attn.k_norm.weight", "model.layers.0.linear_attn.conv1d.weight"):  # fmt: skip
        assert torch.equal(back[name], sd[name]), name
    again = adapter.from_hf(back, config)
    for name, tensor in ours.items():
        assert torch.equal(again[name], tensor), name
    # the q rows really move (partial RoPE pairing), the gate rows do not
    q_hf, q_ours = sd["model.layers.1.self_attn.q_proj.weight"], ours["layers.1.attention.wq.weight"]
    assert not torch.equal(q_hf[:32], q_ours[:32]) and torch.equal(q_hf[32:64], q_ours[32:64])


def test_config_spellings_layouts_and_refusals():
    v5 = make_hf().config.to_dict()
    config = TransformerConfig.from_hf(v5)
    assert TransformerConfig.from_hf(config.to_hf_dict()) == config
    # the published v4 config.json: full_attention_interval, top-level partial_rotary_factor
    v4 = {k: v for k, v in v5.items() if k not in ("layer_types", "rope_parameters")}
    v4.update(full_attention_interval=2, rope_theta=v5["rope_parameters"]["rope_theta"])
    assert TransformerConfig.from_hf(v4) == config
    with pytest.raises(ConfigError, match="layer_types"):
        TransformerConfig.from_hf({**v5, "layer_types": ["linear_attention", "mamba"] * 2})
    with pytest.raises(ConfigError, match="linear_num_key_heads=3 must divide"):
        dataclasses.replace(config, linear_num_key_heads=3)
    debug = build_model_config("qwen3_next", "debug")
    check_layout(debug, ParallelConfig(ep=2, dp_shard=2))
    check_layout(dataclasses.replace(debug, router_aux_loss_scope="layer"), ParallelConfig(pp=2))
    check_layout(debug, ParallelConfig(tp=2))
    with pytest.raises(LayoutError, match="tp=4 does not divide linear_num_key_heads=2"):
        check_layout(debug, ParallelConfig(tp=4), flag="{}")
    check_layout(debug, ParallelConfig(cp=2))
    with pytest.raises(LayoutError, match="cp_mode=hybrid with gated DeltaNet"):
        check_layout(debug, ParallelConfig(cp=4, cp_mode="hybrid", ulysses_degree=2), flag="{}")
    published = build_model_config("qwen3_next", "qwen3-next-80b-a3b")
    assert len(published.linear_attention_layers) == 36 and published.rotary_dim == 64
    # Qwen3.5-MoE's config has no intermediate_size (no dense block): it reads all the same
    every_block_moe = transformers.Qwen3_5MoeTextConfig().to_dict()
    assert "intermediate_size" not in every_block_moe
    moe35 = TransformerConfig.from_hf(every_block_moe)
    assert (moe35.family, moe35.num_layers, moe35.num_experts) == ("qwen3_5_moe", 40, 256)
    assert moe35.mlp_only_layers == () and len(moe35.linear_attention_layers) == 30


# Qwen3.5 shares Qwen3-Next's blocks (its checkpoints split the projections differently, which
# only the adapter sees): its layouts are the slow cases.
QWEN3_5_SLOW = pytest.mark.slow


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["qwen3_next", pytest.param("qwen3_5_moe", marks=QWEN3_5_SLOW)])
def test_ep2_over_dp_shard2_matches_one_process(family):
    """Three AdamW steps under expert parallel give one process's losses, gradients and
    weights (test_models_moe_parallel's comparison), the linear blocks FSDP-sharded."""
    moe_parallel = import_sibling(__file__, "test_models_moe_parallel")
    changes = {"mlp_only_layers": ()}
    results = run_distributed(
        moe_parallel._compare, 2, 2, {"dp_shard": 2, "ep": 2}, family, changes, timeout=300
    )
    assert results[0] == results[1]


def _tp(family):
    families = import_sibling(__file__, "test_models_families")
    return families._step(family, {}, {"sequence_parallel": True})


@pytest.mark.distributed
@pytest.mark.parametrize("family", [
    "qwen3_next", pytest.param("qwen3_5", marks=QWEN3_5_SLOW),
    pytest.param("qwen3_5_moe", marks=QWEN3_5_SLOW),
])  # fmt: skip
def test_tp2_sp_matches_one_process(family):
    """Key-head groups split over tp: projections, convolution channels, decay parameters;
    the gated norm's weight replicated (logits, loss and every gradient)."""
    families = import_sibling(__file__, "test_models_families")
    ranks = run_distributed(_tp, 2, family, timeout=300)
    ref = families._step(family, {})
    assert any("conv_weight" in k for k in ref) and any("attention.norm" in k for k in ref)
    for result in ranks:
        assert result.keys() == ref.keys()
        for key, value in ref.items():
            torch.testing.assert_close(result[key], value, atol=ATOL, rtol=0, msg=key)


# -- Qwen3.5: the same blocks, its linear inputs as four projections ------------------------


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_logits_greedy_and_round_trip(moe):
    cls = transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig
    extra = {k: v for k, v in TINY.items() if moe or k not in (
        "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        "shared_expert_intermediate_size", "mlp_only_layers")}  # fmt: skip
    if moe:
        extra.pop("mlp_only_layers")
    config = cls(**{**extra, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                 "partial_rotary_factor": 0.25}})  # fmt: skip
    hf = _random_hf(config)
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in hf.state_dict()
    ours = models_hf.ours_from(hf)
    assert ours.config.family == ("qwen3_5_moe" if moe else "qwen3_5")
    ids = models_hf.tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=ATOL, rtol=0)
    (prompt,) = models_hf.prompts((11,))
    got = generate(ours, [prompt], GenerationConfig(max_new_tokens=32))[0]
    assert got == models_hf.hf_greedy(hf, prompt)
    adapter = get_model_spec(ours.config.family).hf_adapter
    sd = hf.state_dict()
    back = adapter.to_hf(adapter.from_hf(sd, ours.config), ours.config)
    for name in ("model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.linear_attn.in_proj_z.weight",
                 "model.layers.2.linear_attn.in_proj_b.weight", "model.layers.2.linear_attn.in_proj_a.weight",
                 "model.layers.0.linear_attn.conv1d.weight", "model.layers.1.self_attn.q_proj.weight"):  # fmt: skip
        assert torch.equal(back[name], sd[name]), name
    # a multimodal checkpoint reads as its language model: config.json's text_config, and the
    # weights under model.language_model.* (the vision tower and MTP weights skipped)
    vlm = {"model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": config.to_dict()}
    assert TransformerConfig.from_hf(vlm) == ours.config
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in sd.items()}
    renamed["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    renamed["mtp.fc.weight"] = torch.zeros(3, 3)
    from_vlm = adapter.from_hf(renamed, ours.config)
    for name, tensor in adapter.from_hf(sd, ours.config).items():
        assert torch.equal(from_vlm[name], tensor), name


CP_CASES = {
    "ring_qwen3_next": ("qwen3_next", {"cp": 2}, {"cp_mode": "ring"}, False),
    "ulysses_qwen3_next": ("qwen3_next", {"cp": 2}, {"cp_mode": "ulysses"}, False),
}


def _cp_layouts():
    return import_sibling(__file__, "test_models_cp")._layouts(CP_CASES)


@pytest.mark.distributed
def test_cp2_passes_the_state_along_the_chunks():
    """Zig-zag chunks at cp=2: the convolution's last inputs and the recurrent state go from
    chunk to chunk across the ranks (forward) and their gradients back (loss, every grad)."""
    models_cp = import_sibling(__file__, "test_models_cp")
    models_cp._check(run_distributed(_cp_layouts, 2, timeout=300), CP_CASES)
