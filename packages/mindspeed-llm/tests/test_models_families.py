"""Families beyond the Llama-named ones (Phi-3: fused q/k/v and gate/up in Hugging Face's
names) give transformers' logits (fp32) and their weights go to and from HF unchanged."""

import pytest
import torch

from mindspeed_core.errors import CheckpointError, ConfigError
from mindspeed_core.testing import import_sibling
from mindspeed_llm.models import Transformer, TransformerConfig, get_model_spec

models_hf = import_sibling(__file__, "models_hf")
SEQ, TINY = models_hf.SEQ, models_hf.TINY
make_hf, ours_from, tokens = models_hf.make_hf, models_hf.ours_from, models_hf.tokens
ATOL = 1e-5


@pytest.mark.parametrize("case", list(models_hf.FAMILY_CASES))
def test_logits_match_transformers(case):
    hf = make_hf(case)
    ours = ours_from(hf)
    assert ours.config.family == hf.config.model_type
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
