"""DeepSeek-V3: our decoder with latent attention, grouped sigmoid routing, dense first
blocks and MTP gives transformers' logits and greedy tokens (fp32, random weights), its
weights go to Hugging Face names and back unchanged (MTP layers included), the MTP loss
is the formula, and what we do not build is refused by name."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers

from mindspeed_core.errors import ConfigError
from mindspeed_core.optim import OptimConfig
from mindspeed_core.parallel import ParallelConfig
from mindspeed_llm.data.collate import lm_batch
from mindspeed_llm.generation import GenerationConfig, generate
from mindspeed_llm.models import Transformer, TransformerConfig, build_model_config, get_model_spec
from mindspeed_llm.models.common.layout import LayoutError, check_layout
from mindspeed_llm.models.common.moe_stats import moe_aux_loss
from mindspeed_llm.models.common.mtp import mtp_loss
from mindspeed_llm.train.build import build_model, build_train_parts
from mindspeed_llm.train.objectives import NextToken
from mindspeed_llm.train.step import TrainStep

ATOL = 1e-5
VOCAB, SEQ = 512, 24
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "max_position_embeddings": 256,
    "num_nextn_predict_layers": 0,  # transformers builds no MTP layers
    "pad_token_id": 0,
}
CASES = {
    "low-rank-q": {},
    "full-q": {"q_lora_rank": None},
    "rotate-half": {"rope_interleave": False},
    "yarn": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 0.9,
            "mscale_all_dim": 0.8,
        }
    },
}


_MTP_DEBUG = dataclasses.replace(
    build_model_config("deepseek_v3", "debug", ops_impl="reference"), num_nextn_predict_layers=2
)


def _inputs(batch):
    return {k: batch[k] for k in ("position_ids", "cu_seqlens")} | {"tokens": batch["input_ids"]}


def make_hf(**changes):
    config = transformers.DeepseekV3Config(**{**TINY, **changes})
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():  # HF initialises norms to 1 and the expert bias to 0
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    return model.eval()


def ours_from(hf_model) -> Transformer:
    config = TransformerConfig.from_hf(hf_model.config.to_dict())
    model = get_model_spec(config.family).build(config)
    adapter = get_model_spec(config.family).hf_adapter
    model.load_state_dict(adapter.from_hf(hf_model.state_dict(), config))
    return model.eval()


def tokens(batch=2, seq=SEQ, seed=1):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case):
    hf = make_hf(**CASES[case])
    ours = ours_from(hf)
    config = ours.config
    assert config.family == "deepseek_v3" and config.mlp_only_layers == (0,)
    assert config.num_expert_groups == 4 and config.topk_expert_groups == 2
    ids = tokens()
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    assert got.shape == (2, SEQ, VOCAB)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_group_limit_and_expert_bias_change_the_routing():
    """Each DeepSeek routing piece matters: without it the logits move, so the equality
    above is no accident of unused features."""
    hf = make_hf()
    ids = tokens()
    with torch.no_grad():
        ref = ours_from(hf)(ids)
        for change in (
            {"num_expert_groups": 1, "topk_expert_groups": 1},
            {"routed_scaling_factor": 1.0},
        ):
            config = dataclasses.replace(ours_from(hf).config, **change)
            model = Transformer(config)
            model.load_state_dict(ours_from(hf).state_dict())
            assert not torch.allclose(model.eval()(ids), ref, atol=1e-3), change
        model = ours_from(hf)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.zero_()
        assert not torch.allclose(model(ids), ref, atol=1e-3)


@pytest.mark.parametrize("case", ["low-rank-q", "yarn"])
def test_greedy_with_kv_cache_matches_transformers(case):
    """Decoding through our KV cache (values padded to the key width) gives transformers'
    greedy tokens; a left-padded batch gives the one-by-one tokens."""
    hf = make_hf(**CASES[case])
    ours = ours_from(hf)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (11, 3)]
    config = GenerationConfig(max_new_tokens=12)
    alone = [generate(ours, [p], config)[0] for p in prompts]
    assert generate(ours, prompts, config) == alone
    for prompt, got in zip(prompts, alone, strict=True):
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=12,
            min_new_tokens=12,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert got == out[0, len(prompt) :].tolist()


def test_hf_state_dict_round_trips_with_mtp_layers():
    """transformers' in-memory names -> ours -> DeepSeek checkpoint names -> ours, and the
    checkpoint names back unchanged; MTP module k is model.layers.{3 + k}."""
    hf = make_hf(num_nextn_predict_layers=2)
    config = TransformerConfig.from_hf(hf.config.to_dict())
    assert config.num_nextn_predict_layers == 2
    adapter = get_model_spec("deepseek_v3").hf_adapter
    model = Transformer(config)
    ours = model.state_dict()
    ckpt = adapter.to_hf(ours, config)
    assert "model.layers.4.shared_head.norm.weight" in ckpt
    assert "model.layers.4.mlp.experts.7.down_proj.weight" in ckpt
    assert torch.equal(ckpt["model.layers.3.embed_tokens.weight"], ours["tok_embeddings.weight"])
    back = adapter.from_hf(ckpt, config)
    assert back.keys() == ours.keys()
    for name, tensor in ours.items():
        assert torch.equal(back[name], tensor), name
    again = adapter.to_hf(back, config)
    assert again.keys() == ckpt.keys()
    for name, tensor in ckpt.items():
        assert torch.equal(again[name], tensor), name
    # transformers' fused in-memory experts of the decoder layers read the same way
    main = {k: v for k, v in hf.state_dict().items()}
    mtp = {k: v for k, v in ckpt.items() if k.startswith(("model.layers.3.", "model.layers.4."))}
    fused = adapter.from_hf({**main, **mtp}, config)
    experts = "layers.1.feed_forward.experts.w1"
    gate_up = main["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(fused[experts], gate_up[:, :32].transpose(1, 2))


def test_config_round_trips_and_reads_v4_spelling():
    hf = make_hf(**CASES["yarn"])
    config = TransformerConfig.from_hf(hf.config.to_dict())  # v5: rope_parameters
    assert config.rope_scaling["type"] == "yarn" and config.rope_scaling["mscale_all_dim"] == 0.8
    assert config.head_dim == 24 and config.shared_expert_intermediate_size == 32
    written = config.to_hf_dict()
    assert TransformerConfig.from_hf(written) == config
    v4 = {k: v for k, v in written.items()}  # DeepSeek's own config.json spelling
    assert v4["rope_scaling"]["type"] == "yarn" and "rope_parameters" not in v4
    rebuilt = transformers.DeepseekV3Config(**written)
    assert rebuilt.n_group == 4 and rebuilt.qk_head_dim == 24 and rebuilt.rope_interleave
    published = build_model_config("deepseek_v3", "deepseek-v3")
    assert TransformerConfig.from_hf(published.to_hf_dict()) == dataclasses.replace(
        published, router_bias_update_rate=0.0
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("scoring_func", "softmax"),
        ("topk_method", "group_limited_greedy"),
        ("moe_layer_freq", 2),
        ("hidden_act", "gelu"),
        ("attention_bias", True),
        ("quantization_config", {"quant_method": "fp8", "weight_block_size": [128, 128]}),
    ],
)
def test_refuses_what_we_do_not_build(key, value):
    written = build_model_config("deepseek_v3", "debug").to_hf_dict()
    with pytest.raises(ConfigError, match=key):
        TransformerConfig.from_hf({**written, key: value})


def test_refuses_bad_group_settings_and_parallel_layouts():
    debug = build_model_config("deepseek_v3", "debug")
    with pytest.raises(ConfigError, match="topk_expert_groups"):
        dataclasses.replace(debug, topk_expert_groups=5)
    with pytest.raises(ConfigError, match="num_expert_groups"):
        dataclasses.replace(debug, num_expert_groups=3)
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        dataclasses.replace(debug, kv_lora_rank=None)
    check_layout(debug, ParallelConfig(tp=2, cp=2))  # MTP under tp and cp
    check_layout(debug, ParallelConfig(tp=2, sequence_parallel=True))
    assert check_layout(debug, ParallelConfig(pp=3)) == [1, 1, 1]  # MTP on the last stage
    dense = dataclasses.replace(debug, num_experts=0, num_nextn_predict_layers=0)
    with pytest.raises(LayoutError, match="latent attention splits its heads"):
        check_layout(dense, ParallelConfig(tp=3))
    check_layout(dense, ParallelConfig(tp=2, cp=2))  # heads split over tp, ring over cp


def test_mtp_loss_is_the_formula():
    """scale x mean over depths k of CE(token t+1+k), written out with plain torch ops."""
    torch.manual_seed(0)
    config = dataclasses.replace(
        build_model_config("deepseek_v3", "debug"), num_nextn_predict_layers=2, mtp_loss_scale=0.3
    )
    model = Transformer(config)
    ids = tokens(seq=10)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    labels[0, 2] = -100  # an unsupervised position is skipped at every depth
    hidden = model(ids, return_hidden=True)
    got = mtp_loss(model, ids, labels, hidden)

    emb, head = model.tok_embeddings.weight, model.output.weight
    h, per_depth = hidden, []
    for k, layer in enumerate(model.mtp.layers.values(), start=1):
        ahead = torch.cat([ids[:, k:], torch.zeros(2, k, dtype=ids.dtype)], dim=1)
        merged = torch.cat([layer.enorm(F.embedding(ahead, emb)), layer.hnorm(h)], dim=-1)
        h = layer.block(merged @ layer.eh_proj.weight.T, (model.rope_cos, model.rope_sin))
        logp = torch.log_softmax(layer.norm(h) @ head.T, dim=-1)  # (batch, seq, vocab)
        nll, count = 0.0, 0
        for b in range(2):
            for i in range(10 - k):
                target = labels[b, i + k]
                if target != -100:
                    nll, count = nll - logp[b, i, target], count + 1
        per_depth.append(nll / count)
    expected = 0.3 * sum(per_depth) / len(per_depth)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    got.backward()
    assert model.mtp.layers["4"].eh_proj.weight.grad.abs().sum() > 0


def test_mtp_layers_of_a_checkpoint_are_skipped_by_a_model_without_mtp():
    """As transformers skips them: a checkpoint's MTP layers load into a model without MTP."""
    with_mtp = build_model_config("deepseek_v3", "debug")
    debug = dataclasses.replace(with_mtp, num_nextn_predict_layers=0)
    adapter = get_model_spec("deepseek_v3").hf_adapter
    ckpt = adapter.to_hf(Transformer(with_mtp).state_dict(), with_mtp)
    assert "model.layers.3.eh_proj.weight" in ckpt
    plain = adapter.from_hf(ckpt, debug)
    assert plain.keys() == Transformer(debug).state_dict().keys()


def _packed_batch():
    """Two rows of two documents each (EOD 7), some labels unsupervised."""
    samples = torch.randint(8, VOCAB, (2, 13), generator=torch.Generator().manual_seed(5))
    samples[0, 5] = samples[1, 8] = 7
    batch = lm_batch(samples, 7)
    batch["labels"] = batch["labels"].clone()  # a view of the samples, as input_ids
    batch["labels"][0, 1] = batch["labels"][1, 9] = -100
    return batch


def test_packed_mtp_loss_is_that_of_the_documents_alone():
    """In packed documents depth k at position i is supervised by labels[i + k] only when
    position i + k is in the same document: the loss is the token-weighted mean of each
    document's own loss (one MTP depth)."""
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(_MTP_DEBUG, num_nextn_predict_layers=1)).eval()
    batch = _packed_batch()
    with torch.no_grad():
        model(**_inputs(batch), mtp_labels=batch["labels"])
        packed = model.last_mtp_loss
        nll, count = 0.0, 0
        starts = batch["cu_seqlens"].tolist()
        ids, labels = batch["input_ids"].flatten(), batch["labels"].flatten()
        for start, end in zip(starts, starts[1:], strict=False):
            doc, doc_labels = ids[None, start:end], labels[None, start:end]
            model(doc, mtp_labels=doc_labels)
            n = int((doc_labels[0, 1:] != -100).sum())  # depth 1 targets inside the document
            nll, count = nll + model.last_mtp_loss * n, count + n
    torch.testing.assert_close(packed, nll / count, atol=1e-6, rtol=1e-6)


def test_training_step_adds_the_mtp_loss():
    """The trainer's step backpropagates next-token mean + MTP loss (+ MoE aux) and
    reports the MTP loss as a metric; the step's loss is the objective alone."""
    config = dataclasses.replace(_MTP_DEBUG, router_aux_loss_coef=0.01)
    parallel = ParallelConfig()
    dims = parallel.dims(1).build("cpu")
    built = build_model(config, dims, torch.device("cpu"), parallel=parallel, seq_len=12)
    reference = copy.deepcopy(built.model)
    parts = build_train_parts(built, OptimConfig(lr=1e-3, warmup_steps=0), total_steps=2)
    step = TrainStep(parts, NextToken(), dims, clip_grad=0.0)
    batch = _packed_batch()
    result = step([batch])

    logits = reference(**_inputs(batch), mtp_labels=batch["labels"])
    nll = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    mtp = reference.last_mtp_loss
    (nll + mtp + moe_aux_loss(reference, config)).backward()
    assert result.loss == pytest.approx(float(nll), abs=1e-6)
    assert result.metrics["mtp_loss"] == pytest.approx(float(mtp), abs=1e-6)
    grads = dict(reference.named_parameters())
    for name, p in built.model.named_parameters():
        if p.grad is not None or grads[name].grad is not None:
            torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-6, rtol=0, msg=name)
    assert built.model.mtp.layers["3"].eh_proj.weight.grad.abs().sum() > 0
