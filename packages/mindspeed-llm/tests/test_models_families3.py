"""GLM-4.5 (`glm4_moe`) and MiniMax-M2 (`minimax_m2`) beyond the parametrized parity tests
(test_models_families.py: logits, greedy decoding, state dicts): v4 and v5 config
spellings, each feature moving transformers' own logits (so parity checks it), the
q/k row permutation for partial rotate-half RoPE, MTP layers in GLM's checkpoints, and
what each family refuses."""

import dataclasses

import pytest
import torch

from mindspeed_core.errors import ConfigError
from mindspeed_core.parallel import ParallelConfig
from mindspeed_core.testing import import_sibling
from mindspeed_llm.models import Transformer, TransformerConfig, build_model_config, get_model_spec
from mindspeed_llm.models.common.layout import LayoutError, check_layout

models_hf = import_sibling(__file__, "models_hf")
make_hf, ours_from, tokens = models_hf.make_hf, models_hf.ours_from, models_hf.tokens
ATOL = 2e-5  # as test_models_families.py (our few-row CPU GEMM sums in another order)


def _v4(v5: dict, **top) -> dict:
    """A v5 `to_dict()` in v4's spelling: RoPE keys at the top level."""
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4.update(rope_theta=v5["rope_parameters"]["rope_theta"], **top)
    return v4


# -- GLM-4.5 ------------------------------------------------------------------------------


def test_glm4_moe_reads_v4_and_v5_spellings_and_writes_what_transformers_reads():
    import transformers

    v5 = make_hf("glm4_moe").config.to_dict()
    config = TransformerConfig.from_hf(v5)
    assert config.family == "glm4_moe" and config.rotary_dim == 16 and config.head_dim == 32
    assert config.qkv_bias and config.qk_norm and config.qk_norm_scope == "head"
    assert config.mlp_only_layers == (0,) and config.shared_expert_intermediate_size == 32
    assert (config.num_expert_groups, config.topk_expert_groups) == (4, 2)
    assert config.routed_scaling_factor == 2.5 and not config.shared_expert_gated
    assert TransformerConfig.from_hf(_v4(v5, partial_rotary_factor=0.5)) == config
    written = config.to_hf_dict()
    assert TransformerConfig.from_hf(written) == config
    rebuilt = transformers.Glm4MoeConfig(**written)
    assert rebuilt.rope_parameters["partial_rotary_factor"] == 0.5 and rebuilt.use_qk_norm
    assert rebuilt.n_shared_experts == 1 and rebuilt.first_k_dense_replace == 1
    for name in ("glm-4.5", "glm-4.5-air", "glm-4.6"):
        published = build_model_config("glm4_moe", name)
        assert TransformerConfig.from_hf(published.to_hf_dict()) == dataclasses.replace(
            published, router_bias_update_rate=0.0
        ), name
    air = build_model_config("glm4_moe", "glm-4.5-air")
    assert (air.num_layers, air.num_experts, air.qk_norm, air.rotary_dim) == (46, 128, False, 64)


def test_glm4_moe_features_each_change_the_logits():
    """Partial RoPE, qk-norm, expert groups, the balancing bias and the scaling each move
    the logits: the parity in test_models_families.py checks every one."""
    hf = make_hf("glm4_moe")
    ours, ids = ours_from(hf), tokens()
    with torch.no_grad():
        ref = ours(ids)
        torch.testing.assert_close(ref, hf(ids).logits, atol=ATOL, rtol=0)
    for change in (
        {"rotary_dim": None},
        {"qk_norm": False},
        {"num_expert_groups": 1, "topk_expert_groups": 1},
        {"routed_scaling_factor": 1.0},
    ):
        state = ours.state_dict()
        if change == {"qk_norm": False}:
            state = {k: v for k, v in state.items() if "_norm" not in k or "attention." not in k}
        other = Transformer(dataclasses.replace(ours.config, **change))
        other.load_state_dict(state)
        with torch.no_grad():
            assert not torch.allclose(other.eval()(ids), ref, atol=1e-3), change
    with torch.no_grad():
        for name, b in ours.named_buffers():
            if name.endswith("expert_bias"):
                b.zero_()
        assert not torch.allclose(ours(ids), ref, atol=1e-3)


def test_glm4_moe_rows_are_permuted_for_rotate_half_on_part_of_the_head():
    """GLM rotates pairs (j, j + 8) of the first 16 channels, ours (i, i + 16): the q/k
    rows, biases and qk-norm weights move; without the move the logits differ."""
    hf = make_hf("glm4_moe")
    config = TransformerConfig.from_hf(hf.config.to_dict())
    adapter = get_model_spec("glm4_moe").hf_adapter
    ours = adapter.from_hf(hf.state_dict(), config)
    wq = hf.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    got = ours["layers.0.attention.wq.weight"]
    assert torch.equal(got[16], wq[8]) and torch.equal(got[8], wq[16])  # head 0
    assert torch.equal(got[32 + 17], wq[32 + 9])  # head 1: pair partner of channel 1
    norm = hf.state_dict()["model.layers.0.self_attn.k_norm.weight"]
    assert torch.equal(ours["layers.0.attention.k_norm.weight"][16], norm[8])
    unpermuted = dataclasses.replace(config, rotary_dim=None)
    plain = get_model_spec("glm4_moe").hf_adapter.from_hf(hf.state_dict(), unpermuted)
    model = Transformer(config)
    model.load_state_dict(plain)
    ids = tokens()
    with torch.no_grad():
        assert not torch.allclose(model.eval()(ids), hf(ids).logits, atol=1e-3)


def test_glm4_moe_checkpoint_names_round_trip_with_mtp_layers():
    """ours -> GLM's checkpoint names (MTP module k as model.layers.{3 + k}) -> ours and
    back, bit-identical; a model without MTP skips a checkpoint's MTP layers."""
    config = build_model_config("glm4_moe", "debug", num_nextn_predict_layers=2)
    adapter = get_model_spec("glm4_moe").hf_adapter
    torch.manual_seed(0)
    ours = Transformer(config).state_dict()
    ckpt = adapter.to_hf(ours, config)
    for name in ("model.layers.3.eh_proj.weight", "model.layers.4.shared_head.norm.weight",
                 "model.layers.4.self_attn.q_norm.weight", "model.layers.4.self_attn.k_proj.bias",
                 "model.layers.3.mlp.experts.7.down_proj.weight",
                 "model.layers.3.mlp.gate.e_score_correction_bias"):  # fmt: skip
        assert name in ckpt, name
    assert torch.equal(ckpt["model.layers.4.embed_tokens.weight"], ours["tok_embeddings.weight"])
    back = adapter.from_hf(ckpt, config)
    assert back.keys() == ours.keys()
    assert all(torch.equal(back[k], v) for k, v in ours.items())
    again = adapter.to_hf(back, config)
    assert again.keys() == ckpt.keys()
    assert all(torch.equal(again[k], v) for k, v in ckpt.items())
    plain = dataclasses.replace(config, num_nextn_predict_layers=0)
    assert adapter.from_hf(ckpt, plain).keys() == Transformer(plain).state_dict().keys()


@pytest.mark.parametrize(
    ("key", "value"),
    [("scoring_func", "softmax"), ("hidden_act", "gelu"), ("mlp_bias", True)],
)
def test_glm4_moe_refuses_what_we_do_not_build(key, value):
    written = build_model_config("glm4_moe", "debug").to_hf_dict()
    with pytest.raises(ConfigError, match=key):
        TransformerConfig.from_hf({**written, key: value})


def test_glm4_moe_layouts():
    """As the shared decoder: tp (heads and the dense/shared widths), ep, pp, cp; MTP under
    tp (+sp), cp and pp; writing refuses dense blocks GLM cannot spell."""
    debug = build_model_config("glm4_moe", "debug")
    no_mtp = dataclasses.replace(debug, num_nextn_predict_layers=0)
    check_layout(debug, ParallelConfig(tp=2, sequence_parallel=True))
    check_layout(debug, ParallelConfig(tp=2, cp=2))
    assert check_layout(debug, ParallelConfig(pp=3)) == [1, 1, 1]
    check_layout(debug, ParallelConfig(ep=2, dp_shard=2))
    with pytest.raises(LayoutError, match="tp=4 does not divide num_kv_heads=2"):
        check_layout(no_mtp, ParallelConfig(tp=4))
    check_layout(no_mtp, ParallelConfig(tp=2, sequence_parallel=True, cp=2))
    layer = dataclasses.replace(no_mtp, router_aux_loss_scope="layer")
    assert check_layout(layer, ParallelConfig(pp=3)) == [1, 1, 1]
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        dataclasses.replace(debug, mlp_only_layers=(1,)).to_hf_dict()


# -- MiniMax-M2 ---------------------------------------------------------------------------


def test_minimax_m2_reads_its_published_and_v5_spellings():
    """The published config.json (remote-code keys: `rotary_dim`, `scoring_func`,
    `qk_norm_type`, `attn_type_list`, MTP keys) and v5's `rope_parameters` read the same;
    the written config builds transformers' config with RoPE on half of each head."""
    import transformers

    v5 = make_hf("minimax_m2").config.to_dict()
    config = TransformerConfig.from_hf(v5)
    assert config.family == "minimax_m2" and config.rotary_dim == 16
    assert config.qk_norm and config.qk_norm_scope == "all" and not config.qkv_bias
    assert config.router_score == "sigmoid" and config.norm_topk_prob
    assert config.num_experts == 8 and config.moe_intermediate_size == 32
    assert not config.shared_expert_intermediate_size and config.mlp_only_layers == ()
    published = _v4(v5, rotary_dim=16, scoring_func="sigmoid", use_qk_norm=True,
                    qk_norm_type="per_layer", attn_type_list=[1, 1], shared_intermediate_size=0,
                    use_routing_bias=True, use_mtp=True, num_mtp_modules=3)  # fmt: skip
    assert TransformerConfig.from_hf(published) == config
    written = config.to_hf_dict()
    assert TransformerConfig.from_hf(written) == config
    rebuilt = transformers.MiniMaxM2Config(**written)
    assert rebuilt.rope_parameters["partial_rotary_factor"] == 0.5
    assert rebuilt.num_local_experts == 8 and rebuilt.intermediate_size == 32
    m2 = build_model_config("minimax_m2", "minimax-m2")
    assert TransformerConfig.from_hf(m2.to_hf_dict()) == dataclasses.replace(
        m2, router_bias_update_rate=0.0
    )
    no_theta = {k: v for k, v in published.items() if k != "rope_theta"}
    assert TransformerConfig.from_hf(no_theta).rope_theta == 5e6  # transformers' default


def _unit_qk_norms(model: Transformer, config: TransformerConfig) -> torch.Tensor:
    """Logits of `model`'s weights under `config`, every q/k norm weight set to 1."""
    other = Transformer(config)
    norms = {k: torch.ones_like(v) for k, v in other.state_dict().items()
             if k.endswith(("attention.q_norm.weight", "attention.k_norm.weight"))}  # fmt: skip
    other.load_state_dict({**model.state_dict(), **norms})
    with torch.no_grad():
        return other.eval()(tokens())


def test_minimax_m2_norm_over_all_heads_partial_rope_and_bias_count():
    """q_norm / k_norm span every head (a norm per head gives other logits, unit weights on
    both sides), and partial RoPE and the balancing bias each move the logits: the parity
    in test_models_families.py checks each."""
    hf = make_hf("minimax_m2")
    ours, ids = ours_from(hf), tokens()
    attention = ours.layers["0"].attention
    assert attention.q_norm.weight.shape == (4 * 32,) and attention.k_norm.weight.shape == (2 * 32,)
    per_head = dataclasses.replace(ours.config, qk_norm_scope="head")
    all_heads = _unit_qk_norms(ours, ours.config)
    assert not torch.allclose(_unit_qk_norms(ours, per_head), all_heads, atol=1e-3)
    with torch.no_grad():
        ref = ours(ids)
        full = Transformer(dataclasses.replace(ours.config, rotary_dim=None))
        full.load_state_dict(ours.state_dict())
        assert not torch.allclose(full.eval()(ids), ref, atol=1e-3)
        for name, b in ours.named_buffers():
            if name.endswith("expert_bias"):
                b.zero_()
        assert not torch.allclose(ours(ids), ref, atol=1e-3)


def test_minimax_m2_skips_mtp_layers_and_writes_checkpoint_names():
    """Checkpoint names (Mixtral's under block_sparse_moe, the bias beside the gate) go to
    ours and back bit-identical; layers past num_hidden_layers (MTP) are skipped."""
    config = build_model_config("minimax_m2", "debug")
    adapter = get_model_spec("minimax_m2").hf_adapter
    torch.manual_seed(0)
    ours = Transformer(config).state_dict()
    ckpt = adapter.to_hf(ours, config)
    for name in ("model.layers.1.block_sparse_moe.e_score_correction_bias",
                 "model.layers.1.block_sparse_moe.gate.weight",
                 "model.layers.1.block_sparse_moe.experts.7.w2.weight",
                 "model.layers.1.self_attn.q_norm.weight"):  # fmt: skip
        assert name in ckpt, name
    mtp = {"model.layers.2.self_attn.q_proj.weight": torch.zeros(128, 64)}
    back = adapter.from_hf({**ckpt, **mtp}, config)
    assert back.keys() == ours.keys()
    assert all(torch.equal(back[k], v) for k, v in ours.items())
    again = adapter.to_hf(back, config)
    assert again.keys() == ckpt.keys()
    assert all(torch.equal(again[k], v) for k, v in ckpt.items())


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("scoring_func", "softmax"),
        ("shared_intermediate_size", 64),
        ("router_jitter_noise", 0.1),
        ("attn_type_list", [0, 1]),
        ("qk_norm_type", "per_head"),
        ("hidden_act", "gelu"),
    ],
)
def test_minimax_m2_refuses_what_we_do_not_build(key, value):
    written = build_model_config("minimax_m2", "debug").to_hf_dict()
    with pytest.raises(ConfigError, match=key):
        TransformerConfig.from_hf({**written, key: value})


def test_minimax_m2_layouts_and_configs_it_cannot_write():
    """tp (the norm over all heads sums its squares over the tp ranks, see
    test_models_moe_layouts.py), ep, pp and cp are accepted; tp must still divide the kv
    heads; a config MiniMax-M2's keys cannot say is refused on writing, naming the field."""
    debug = build_model_config("minimax_m2", "debug")
    check_layout(debug, ParallelConfig(tp=2, sequence_parallel=True, cp=2))
    check_layout(debug, ParallelConfig(ep=2, dp_shard=2, cp=2))
    with pytest.raises(LayoutError, match="tp=4 does not divide num_kv_heads=2"):
        check_layout(debug, ParallelConfig(tp=4))
    layer = dataclasses.replace(debug, router_aux_loss_scope="layer")
    assert check_layout(layer, ParallelConfig(pp=2)) == [1, 1]
    with pytest.raises(ConfigError, match="qk_norm_scope='rows'"):
        dataclasses.replace(debug, qk_norm_scope="rows")
    for change in ({"qk_norm_scope": "head"}, {"shared_expert_intermediate_size": 32},
                   {"routed_scaling_factor": 2.0}):  # fmt: skip
        with pytest.raises(ConfigError, match=next(iter(change))):
            dataclasses.replace(debug, **change).to_hf_dict()


@pytest.mark.parametrize(
    ("family", "flavor", "total", "active"),
    [
        ("glm4_moe", "glm-4.5", 355, 32),
        ("glm4_moe", "glm-4.5-air", 106, 12),
        ("glm4_moe", "glm-4.6", 355, 32),
        ("minimax_m2", "minimax-m2", 230, 10),
    ],
)
def test_published_flavors_have_the_model_cards_sizes(family, flavor, total, active):
    """The model cards' round sizes (billions, MTP modules left out; active: the experts a
    token uses plus attention and dense blocks, without the embedding and head), so a
    mistyped width or count shows."""
    from mindspeed_llm.models.common.moe_stats import active_params

    spec = get_model_spec(family)
    with torch.device("meta"):
        model = spec.build(dataclasses.replace(spec.flavors[flavor], num_nextn_predict_layers=0))
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    assert billions == pytest.approx(total, rel=0.01)
    head = model.output.weight.numel()  # active_params counts the head, not the embedding
    assert (active_params(model) - head) / 1e9 == pytest.approx(active, rel=0.06)
