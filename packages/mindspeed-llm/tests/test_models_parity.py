"""Our models give Hugging Face transformers' logits (fp32) with weights copied through
`from_hf`, for every family and RoPE scaling, and packed documents stay independent."""

import pytest
import torch

from mindspeed_core.testing import import_sibling
from mindspeed_llm.models import Transformer, TransformerConfig, build_model_config
from mindspeed_llm.models.common import hf_adapter

models_hf = import_sibling(__file__, "models_hf")
CASES, SEQ, TINY = models_hf.CASES, models_hf.SEQ, models_hf.TINY
make_hf, ours_from, tokens = models_hf.make_hf, models_hf.ours_from, models_hf.tokens
ATOL = 1e-5


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case):
    hf = make_hf(case)
    ours = ours_from(hf)
    ids = tokens()
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    assert got.shape == (2, SEQ, TINY["vocab_size"])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_family_flags_come_from_hf():
    assert ours_from(make_hf("qwen2")).config.qkv_bias
    qwen3 = ours_from(make_hf("qwen3")).config
    assert qwen3.qk_norm and qwen3.head_dim == 32
    assert ours_from(make_hf("mistral-window")).config.sliding_window == 8
    assert ours_from(make_hf("llama-yarn")).config.rope_scaling["type"] == "yarn"


def test_mistral_window_really_masks():
    """Without the window the logits differ, so the parity above checks the window."""
    windowed, full = make_hf("mistral-window"), make_hf("mistral-window", sliding_window=None)
    ids = tokens()
    with torch.no_grad():
        assert not torch.allclose(windowed(ids).logits[:, 8:], full(ids).logits[:, 8:], atol=1e-3)
        torch.testing.assert_close(windowed(ids).logits[:, :8], full(ids).logits[:, :8])


@pytest.mark.parametrize("case", list(CASES))
def test_state_dict_round_trip(case):
    hf = make_hf(case)
    config = TransformerConfig.from_hf(hf.config.to_dict())
    sd = hf.state_dict()
    back = hf_adapter.to_hf(hf_adapter.from_hf(sd, config), config)
    if config.tie_word_embeddings:  # HF saves a tied head once, as the embedding
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    assert back.keys() == sd.keys()
    assert all(back[k] is sd[k] for k in sd)
    ours = Transformer(config).state_dict()
    assert hf_adapter.from_hf(sd, config).keys() == ours.keys()


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_packed_documents_match_separate_runs(family):
    config = build_model_config(
        family, flavor="debug", sliding_window=4 if family == "mistral" else None
    )
    torch.manual_seed(0)
    model = Transformer(config).eval()
    lengths = [5, 11, 9, 7]  # two rows of 16: docs 5+11 in row 0, 9+7 in row 1
    docs = [tokens(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    packed = torch.cat(docs, dim=1).view(2, 16)
    cu_seqlens = torch.tensor([0, 5, 16, 25, 32], dtype=torch.int32)
    with torch.no_grad():
        got = model(packed, cu_seqlens=cu_seqlens).flatten(0, 1)
        alone = torch.cat([model(d)[0] for d in docs])
        explicit = model(
            packed, position_ids=_positions(lengths).view(2, 16), cu_seqlens=cu_seqlens
        )
        unpacked = model(packed).flatten(0, 1)
    torch.testing.assert_close(got, alone, atol=ATOL, rtol=0)
    torch.testing.assert_close(explicit.flatten(0, 1), alone, atol=ATOL, rtol=0)
    assert not torch.allclose(unpacked[5:16], alone[5:16], atol=1e-3)  # packing matters


def _positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths])


def test_meta_init_matches_eager_init():
    config = build_model_config("qwen2", flavor="debug")
    eager = Transformer(config)
    torch.manual_seed(3)
    eager.init_weights()
    with torch.device("meta"):
        lazy = Transformer(config)
    lazy.to_empty(device="cpu")
    torch.manual_seed(3)
    lazy.init_weights()
    for (name, a), b in zip(eager.state_dict().items(), lazy.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    torch.testing.assert_close(lazy.rope_cos, eager.rope_cos, atol=0, rtol=0)
    ids = tokens()
    torch.testing.assert_close(lazy(ids), eager(ids), atol=0, rtol=0)
    # deterministic and not degenerate: std as configured, norms 1, biases 0
    assert abs(eager.tok_embeddings.weight.std().item() - config.init_std) < 2e-3
    assert torch.all(eager.norm.weight == 1)
    assert torch.all(eager.layers["0"].attention.wq.bias == 0)


def test_tied_embeddings_share_one_tensor():
    config = build_model_config("qwen2", flavor="debug", tie_word_embeddings=True)
    model = Transformer(config)
    assert model.output.weight is model.tok_embeddings.weight
    with torch.device("meta"):
        lazy = Transformer(config)
    lazy.to_empty(device="cpu")
    lazy.init_weights()
    assert lazy.output.weight is lazy.tok_embeddings.weight


def test_bf16_forward_and_backward_run():
    config = build_model_config("qwen3", flavor="debug")
    model = Transformer(config).to(torch.bfloat16)
    logits = model(tokens())
    assert logits.dtype == torch.bfloat16
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("rows", [1, SEQ], ids=["one-token", "full"])
def test_bf16_autocast_matches_transformers(rows):
    # fp32 weights under bf16 autocast: one-process mixed-precision training and its eval.
    # One row is the decode shape, where inference linears may take mindspeed-ops' CPU kernel
    # outside autocast; under it the product's dtype is autocast's (bf16), as transformers'.
    hf = make_hf("qwen2")
    ours = ours_from(hf)
    ids = tokens()[:, :rows]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = ours(ids), hf(ids).logits
    assert got.dtype == torch.bfloat16 and want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
