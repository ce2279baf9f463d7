"""Families beyond the Llama-named ones (Phi-3: fused q/k/v and gate/up in Hugging Face's
names; Gemma 2: soft caps, post norms, alternating windows, GeGLU) give transformers'
logits (fp32), their weights go to and from HF unchanged, and tp=2 gives one process's
logits and gradients."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from mindspeed_core.errors import CheckpointError, ConfigError
from mindspeed_core.parallel import ParallelDims, loss_parallel_context
from mindspeed_core.testing import import_sibling, run_distributed
from mindspeed_llm.generation import GenerationConfig, generate
from mindspeed_llm.models import (
    Transformer,
    TransformerConfig,
    build_model_config,
    get_model_spec,
)

models_hf = import_sibling(__file__, "models_hf")
SEQ, TINY = models_hf.SEQ, models_hf.TINY
make_hf, ours_from, tokens = models_hf.make_hf, models_hf.ours_from, models_hf.tokens
# Inference forwards of up to 64 tokens run our few-row CPU GEMM (mindspeed_ops.linear), whose
# fp32 sums run in another order than oneDNN's in transformers. Both are fp32-accurate, not
# bit-equal: on gemma3 (logits up to ~5) ours is within 1.1e-5 and transformers within 0.9e-5
# of transformers run in fp64, and they differ from each other by up to 1.8e-5.
ATOL = 2e-5


@pytest.mark.parametrize("case", list(models_hf.FAMILY_CASES))
def test_logits_match_transformers(case):
    hf = make_hf(case)
    ours = ours_from(hf)
    assert ours.config.family == hf.config.model_type.removesuffix("_text")
    ids = tokens()
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    assert got.shape == (2, SEQ, TINY["vocab_size"])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", list(models_hf.FAMILY_CASES))
def test_state_dict_round_trip(case):
    hf = make_hf(case)
    config = TransformerConfig.from_hf(hf.config.to_dict())
    adapter = get_model_spec(config.family).hf_adapter
    sd = hf.state_dict()
    ours = adapter.from_hf(sd, config)
    assert ours.keys() == Transformer(config).state_dict().keys()
    back = adapter.to_hf(ours, config)
    if config.num_experts:
        # transformers v5 fuses (and may rename) the MoE blocks in memory, so to_hf gives
        # checkpoint names there (test_convert.py): ours -> those -> ours is exact, and
        # every tensor outside the feed-forward blocks comes back as it was
        again = adapter.from_hf(back, config)
        assert again.keys() == ours.keys()
        assert all(torch.equal(again[k], v) for k, v in ours.items())
        sd, back = (
            {k: v for k, v in d.items() if not re.search(r"\.(mlp|block_sparse_moe)\.", k)}
            for d in (sd, back)
        )
    if config.tie_word_embeddings:  # HF saves a tied head once, as the embedding
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    assert back.keys() == sd.keys()
    for name, tensor in sd.items():
        assert torch.equal(back[name], tensor), name


def test_phi3_fused_weights_split_in_order():
    hf = make_hf("phi3")
    ours = ours_from(hf)
    assert ours.config.sliding_window == 8
    qkv = hf.model.layers[1].self_attn.qkv_proj.weight
    gate_up = hf.model.layers[1].mlp.gate_up_proj.weight
    attn, ffn = ours.layers["1"].attention, ours.layers["1"].feed_forward
    assert torch.equal(qkv, torch.cat([attn.wq.weight, attn.wk.weight, attn.wv.weight]))
    assert torch.equal(gate_up, torch.cat([ffn.w1.weight, ffn.w3.weight]))  # gate first


def test_phi3_refuses_longrope_and_a_bad_fused_tensor():
    hf = make_hf("phi3")
    config = hf.config.to_dict()
    longrope = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}
    config["rope_parameters"] = config["rope_scaling"] = longrope
    with pytest.raises(ConfigError, match="longrope"):
        TransformerConfig.from_hf(config)
    ours = TransformerConfig.from_hf(hf.config.to_dict())
    adapter = get_model_spec("phi3").hf_adapter
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    sd = dict(hf.state_dict())
    with pytest.raises(CheckpointError, match="qkv_proj.weight has 127 rows"):
        adapter.from_hf({**sd, qkv: sd[qkv][:-1]}, ours)
    del sd["model.layers.0.mlp.gate_up_proj.weight"]
    with pytest.raises(CheckpointError, match="missing model.layers.0.mlp.gate_up_proj"):
        adapter.from_hf(sd, ours)


def test_gemma2_features_each_change_the_logits():
    """So the parity above checks each: without it transformers' own logits differ."""
    hf = make_hf("gemma2")
    config = ours_from(hf).config
    assert config.full_attention_layers == (1,) and config.sliding_window == 8
    assert config.post_norms and config.norm_unit_offset and config.tie_word_embeddings
    ids = tokens()
    with torch.no_grad():
        base = hf(ids).logits
        for change in (
            {"attn_logit_softcapping": None},
            {"final_logit_softcapping": None},
            {"layer_types": ["full_attention"] * 2},
            {"query_pre_attn_scalar": 16},
        ):
            other = make_hf("gemma2", **change)
            assert not torch.allclose(other(ids).logits, base, atol=1e-3), change
            torch.testing.assert_close(ours_from(other)(ids), other(ids).logits, atol=ATOL, rtol=0)


def test_gemma2_packed_documents_match_separate_runs():
    model = ours_from(make_hf("gemma2"))
    lengths = [5, 19, 13, 11]  # two rows of 24
    docs = [tokens(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    packed = torch.cat(docs, dim=1).view(2, SEQ)
    cu_seqlens = torch.tensor([0, 5, 24, 37, 48], dtype=torch.int32)
    with torch.no_grad():
        got = model(packed, cu_seqlens=cu_seqlens).flatten(0, 1)
        alone = torch.cat([model(d)[0] for d in docs])
    torch.testing.assert_close(got, alone, atol=ATOL, rtol=0)


def test_gemma2_config_round_trips_and_refuses_what_it_lacks():
    hf = make_hf("gemma2")
    config = TransformerConfig.from_hf(hf.config.to_dict())
    again = TransformerConfig.from_hf(config.to_hf_dict())
    assert again == config
    bad = {**hf.config.to_dict(), "use_bidirectional_attention": True}
    with pytest.raises(ConfigError, match="use_bidirectional_attention"):
        TransformerConfig.from_hf(bad)
    with pytest.raises(ConfigError, match="hidden_activation='gelu'"):
        TransformerConfig.from_hf({**hf.config.to_dict(), "hidden_activation": "gelu"})
    with pytest.raises(ConfigError, match="full_attention_layers"):
        TransformerConfig(**{**config.__dict__, "full_attention_layers": (5,)})


def test_glm4_reads_v4_and_v5_spellings_and_its_partial_rotary_counts():
    """v5 keeps partial_rotary_factor in rope_parameters, v4 at the top level; both give
    rotary_dim, the written config reads back equal, and RoPE on a quarter of each head is
    not RoPE on all of it (the pass-through channels get no rotation)."""
    hf = make_hf("glm4")
    v5 = hf.config.to_dict()
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4.update(rope_theta=10000.0, partial_rotary_factor=0.25)
    config = TransformerConfig.from_hf(v5)
    assert config.rotary_dim == 8 and config.qkv_bias and config.post_norms
    assert TransformerConfig.from_hf(v4) == config
    assert TransformerConfig.from_hf(config.to_hf_dict()) == config
    ours, ids = ours_from(hf), tokens()
    full = Transformer(TransformerConfig(**{**config.__dict__, "rotary_dim": None}))
    full.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (ours(ids) - full.eval()(ids)).abs().max() > 1e-3
    with pytest.raises(ConfigError, match="attention_bias=false"):
        TransformerConfig.from_hf({**v5, "attention_bias": False})
    with pytest.raises(ConfigError, match="rotary_dim=7"):
        TransformerConfig(**{**config.__dict__, "rotary_dim": 7})


def test_internlm3_reads_its_remote_code_bias_spelling():
    """The published config.json spells the biases qkv_bias / bias (transformers maps them to
    attention_bias / mlp_bias); false is read, true refused; dynamic RoPE scaling refused."""
    v5 = make_hf("internlm3").config.to_dict()
    config = TransformerConfig.from_hf({**v5, "qkv_bias": False, "bias": False})
    assert config.family == "internlm3" and not config.qkv_bias and config.rope_theta == 5e7
    for key in ("qkv_bias", "bias"):
        with pytest.raises(ConfigError, match=f"{key}=true"):
            TransformerConfig.from_hf({**v5, key: True})
    with pytest.raises(ConfigError, match="'dynamic' is not supported"):
        TransformerConfig.from_hf({**v5, "rope_parameters": None, "rope_theta": 5e7,
                                   "rope_scaling": {"rope_type": "dynamic", "factor": 6.0}})  # fmt: skip


TP_CASES = {  # name: (family, config changes, parallelize options)
    "gemma2_tp2_sp_loss_parallel": (
        "gemma2",
        {"tie_word_embeddings": False, "sliding_window": 4},
        {"sequence_parallel": True, "loss_parallel": True},
    ),
    "phi3_tp2": ("phi3", {"sliding_window": 8}, {}),
    "glm4_tp2_sp": ("glm4", {}, {"sequence_parallel": True}),
    "glm_tp2_sp": ("glm", {}, {"sequence_parallel": True}),
    "internlm2_tp2_sp": ("internlm2", {}, {"sequence_parallel": True}),
    "gemma3_tp2_sp": (
        "gemma3",
        {"tie_word_embeddings": False, "sliding_window": 4},
        {"sequence_parallel": True},
    ),
}


def _step(family, changes, options=None):
    """Logits, loss and gradients of one step; no options: the one-process reference."""
    spec = get_model_spec(family)
    torch.manual_seed(0)
    model = spec.build(build_model_config(family, flavor="debug", **changes))
    if options is not None:
        model = spec.parallelize(model, ParallelDims(tp=2).build(), **options)
    gen = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, 512, (2, 16), generator=gen) for _ in range(2))
    with loss_parallel_context((options or {}).get("loss_parallel", False)):
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach()

    grads = {n: full(p.grad) for n, p in model.named_parameters()}
    return {"logits": full(logits), "loss": full(loss), **grads}


def _tp_cases():
    return {
        name: _step(family, changes, options)
        for name, (family, changes, options) in TP_CASES.items()
    }


@pytest.mark.distributed
def test_tp2_matches_one_process():
    ranks = run_distributed(_tp_cases, 2, timeout=300)
    for name, (family, changes, _) in TP_CASES.items():
        ref = _step(family, changes)
        assert len(ref) > 10  # logits, loss and every parameter's gradient
        for results in ranks:
            assert results[name].keys() == ref.keys(), name
            for key, value in ref.items():
                torch.testing.assert_close(
                    results[name][key], value, atol=ATOL, rtol=0, msg=f"{name} {key}"
                )


@pytest.mark.parametrize("case", list(models_hf.FAMILY_CASES))
def test_greedy_with_kv_cache_matches_transformers(case):
    """Decoding through our KV cache (Gemma 2: soft caps and alternating windows there too)
    gives transformers' greedy tokens; a left-padded batch gives the one-by-one tokens."""
    hf = make_hf(case)
    ours = ours_from(hf)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (11, 3)]
    config = GenerationConfig(max_new_tokens=32)
    alone = [generate(ours, [p], config)[0] for p in prompts]
    assert generate(ours, prompts, config) == alone
    for prompt, got in zip(prompts, alone, strict=True):
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=32,
            min_new_tokens=32,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert got == out[0, len(prompt) :].tolist()


def test_gemma3_local_rope_and_qk_norms_count():
    hf = make_hf("gemma3")
    config = ours_from(hf).config
    assert config.local_rope_theta == 10000.0 and config.rope_theta == 1e6
    assert config.rope_scaling["type"] == "linear" and config.qk_norm
    assert TransformerConfig.from_hf(config.to_hf_dict()) == config
    ids = tokens()
    rope = hf.config.rope_parameters
    other = make_hf("gemma3", rope_parameters={**rope, "sliding_attention": {"rope_theta": 50.0}})
    with torch.no_grad():
        assert not torch.allclose(other(ids).logits, hf(ids).logits, atol=1e-3)
        torch.testing.assert_close(ours_from(other)(ids), other(ids).logits, atol=ATOL, rtol=0)


def test_hidden_states_then_project_give_the_logits():
    """What eval's scorer does (final soft cap included)."""
    model = ours_from(make_hf("gemma2"))
    ids = tokens()
    with torch.no_grad():
        hidden = model(ids, return_hidden=True)
        assert hidden.shape == (2, SEQ, TINY["hidden_size"])
        torch.testing.assert_close(model.project(hidden[:, 5:]), model(ids)[:, 5:])
        assert model(ids).abs().max() <= model.config.final_logit_softcapping
