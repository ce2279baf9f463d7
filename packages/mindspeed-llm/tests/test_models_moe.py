"""MoE families: logits and aux loss equal transformers' (fp32), Hugging Face names both
ways, router units (normalised top-k, capacity dropping, aux-loss-free bias), bad configs."""

import pytest
import torch
import transformers

from mindspeed_core.errors import ConfigError
from mindspeed_core.parallel.materialize import ParamInit
from mindspeed_llm.models import Transformer, TransformerConfig, build_model_config, get_model_spec
from mindspeed_llm.models.common.moe import MoE, load_balancing_loss
from mindspeed_llm.models.common.moe_stats import LoadTracker, moe_aux_loss, moe_layers

ATOL = 1e-5
TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "num_experts_per_tok": 2,
}
CASES = {
    "mixtral": ("MixtralConfig", {"num_local_experts": 4}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {"num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48},
    ),
    "qwen2_moe-mlp-only": (
        "Qwen2MoeConfig",
        {
            "num_experts": 4,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "mlp_only_layers": [1],
            "norm_topk_prob": True,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 4, "moe_intermediate_size": 32, "head_dim": 32, "norm_topk_prob": True},
    ),
}


def make_hf(case):
    cls_name, extra = CASES[case]
    config = getattr(transformers, cls_name)(**{**TINY, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.08)
    return model.eval()


def adapter(config):
    """The family's weight-name adapter (a `moe_hf_adapter.MoEAdapter`)."""
    return get_model_spec(config.family).hf_adapter


def ours_from(hf_model) -> Transformer:
    config = TransformerConfig.from_hf(hf_model.config.to_dict())
    model = Transformer(config)
    model.load_state_dict(adapter(config).from_hf(hf_model.state_dict(), config))
    return model.eval()


def tokens(batch=2, seq=24, seed=1):
    return torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_aux_loss_match_transformers(case):
    hf = make_hf(case)
    ours = ours_from(hf)
    ids = tokens()
    with torch.no_grad():
        out = hf(ids, output_router_logits=True)
        got = ours(ids)
    torch.testing.assert_close(got, out.logits, atol=ATOL, rtol=0)
    stats = [m.last_stats for m in moe_layers(ours).values()]
    assert len(stats) == (1 if "mlp-only" in case else 2)
    aux = load_balancing_loss(stats, ours.config.num_experts)
    torch.testing.assert_close(aux, out.aux_loss, atol=1e-6, rtol=1e-6)
    coef = ours.config.router_aux_loss_coef
    assert coef == hf.config.router_aux_loss_coef
    torch.testing.assert_close(moe_aux_loss(ours, ours.config), coef * out.aux_loss)


@pytest.mark.parametrize("case", list(CASES))
def test_hf_names_round_trip(case):
    """Checkpoint names (what save_pretrained writes) both ways, and v5 in-memory names in."""
    hf = make_hf(case)
    config = TransformerConfig.from_hf(hf.config.to_dict())
    ours = adapter(config).from_hf(hf.state_dict(), config)  # v5 fused in-memory tensors
    assert ours.keys() == Transformer(config).state_dict().keys()
    on_disk = adapter(config).to_hf(ours, config)
    back = adapter(config).from_hf(on_disk, config)
    assert back.keys() == ours.keys()
    assert all(torch.equal(back[k], ours[k]) for k in ours)
    again = adapter(config).to_hf(back, config)
    assert again.keys() == on_disk.keys()
    assert all(torch.equal(again[k], on_disk[k]) for k in on_disk)


def test_save_pretrained_names_load(tmp_path):
    from safetensors.torch import load_file

    hf = make_hf("mixtral")
    hf.save_pretrained(tmp_path)
    config = TransformerConfig.from_hf(tmp_path)
    on_disk = load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in on_disk
    ours = adapter(config).from_hf(on_disk, config)
    assert adapter(config).to_hf(ours, config).keys() == on_disk.keys()
    fused = adapter(config).from_hf(hf.state_dict(), config)
    assert all(torch.equal(ours[k], fused[k]) for k in ours)


def test_to_hf_dict_round_trip():
    for family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        config = build_model_config(family, flavor="debug")
        again = TransformerConfig.from_hf(config.to_hf_dict())
        for field in ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size"):
            assert getattr(again, field) == getattr(config, field), (family, field)
        assert again.norm_topk_prob == config.norm_topk_prob


def _moe(**changes):
    config = build_model_config("mixtral", flavor="debug", **changes)
    torch.manual_seed(0)
    block = MoE(config)
    block.init_weights(ParamInit(block, 0), 0.1, 0.1)
    return block


def test_router_weights_sum_to_one_when_normalised():
    x = torch.randn(32, 64)
    block = _moe()
    _, weights, _, _ = block.router(x)
    torch.testing.assert_close(weights.sum(-1), torch.ones(32))
    _, raw, _, _ = _moe(norm_topk_prob=False).router(x)
    assert (raw.sum(-1) < 1).all()


def test_capacity_drops_over_capacity_tokens():
    x = torch.randn(32, 64)
    dropless = _moe()
    counts = torch.bincount(dropless.router(x)[0].flatten(), minlength=4)
    capacity = 16  # ceil(1.0 * 32 tokens * 2 / 4 experts)
    block = _moe(capacity_factor=1.0)
    out = block(x.view(2, 16, 64))
    assert block.last_stats.num_dropped == int((counts - capacity).clamp(min=0).sum()) > 0
    assert out.shape == (2, 16, 64)
    # A big enough capacity drops nothing and gives the dropless output.
    roomy = _moe(capacity_factor=4.0)
    torch.testing.assert_close(roomy(x.view(2, 16, 64)), dropless(x.view(2, 16, 64)))
    assert roomy.last_stats.num_dropped == 0


def test_aux_free_bias_moves_toward_balance():
    block = _moe(router_score="sigmoid", router_bias_update_rate=0.05)
    with torch.no_grad():  # expert 0 is almost every token's favourite
        block.router.weight[0] = 0.05
    tracker = LoadTracker(block, 0.05)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0)) + 1
    spreads = []
    for _ in range(30):
        with torch.no_grad():
            block(x)
        tracker.observe()
        metrics = tracker.step()
        spreads.append(metrics["moe_max_load"] - metrics["moe_min_load"])
    assert spreads[0] > 1.5 and sum(spreads[-10:]) / 10 < 0.6 * spreads[0]
    assert block.router.expert_bias[0] < 0 and "router.expert_bias" in block.state_dict()


def test_z_loss_and_coefficients():
    model = Transformer(build_model_config("mixtral", flavor="debug", router_z_loss_coef=0.1))
    model(tokens())
    stats = [m.last_stats for m in moe_layers(model).values()]
    expected = (
        0.01 * load_balancing_loss(stats, 4) + 0.1 * torch.stack([s.z_loss for s in stats]).mean()
    )
    torch.testing.assert_close(moe_aux_loss(model, model.config), expected)
    dense = Transformer(build_model_config("llama", flavor="debug"))
    dense(tokens())
    assert moe_aux_loss(dense, dense.config) is None


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_experts_per_tok": 5}, "num_experts_per_tok=5"),
        ({"router_score": "relu"}, "router_score='relu'"),
        ({"router_bias_update_rate": 0.1}, "router_bias_update_rate=0.1"),
        ({"capacity_factor": 0.0}, "capacity_factor=0.0"),
        ({"router_aux_loss_coef": -1.0}, "router_aux_loss_coef=-1.0"),
    ],
)
def test_bad_moe_config(changes, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(")):
        build_model_config("mixtral", flavor="debug", **changes)
