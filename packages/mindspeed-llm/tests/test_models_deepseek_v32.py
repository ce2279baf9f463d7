"""DeepSeek-V3.2 (DeepSeek Sparse Attention): the indexer chooses transformers' keys, each
query attends to those only (equal to dense attention restricted to them), and the model gives
transformers' logits and greedy tokens through our cache (sparse there too); the indexer's KL
loss trains the indexer alone; weights go to and from Hugging Face bit-identically; tp=2
(+SP) equals one process."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers

from mindspeed_core.errors import ConfigError
from mindspeed_core.parallel import ParallelConfig
from mindspeed_core.testing import import_sibling, run_distributed
from mindspeed_llm.generation import GenerationConfig, generate
from mindspeed_llm.models import Transformer, TransformerConfig, build_model_config, get_model_spec
from mindspeed_llm.models.common.layout import LayoutError, check_layout
from mindspeed_llm.models.common.mla import index_kl_loss, select_keys, sparse_attention

models_hf = import_sibling(__file__, "models_hf")
ATOL = 2e-5

TINY = {
    **models_hf.TINY,
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "first_k_dense_replace": 1,
    "n_routed_experts": 8,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "index_topk": 8,  # below the 24-token rows: attention is sparse
    "index_n_heads": 8,  # ties at a zero score (every head's relu 0) made rare: see select_keys
    "index_head_dim": 16,
}


def make_hf(**changes):
    config = transformers.DeepseekV32Config(**{**TINY, **changes})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.08)
    return model.eval()


def test_logits_match_transformers_and_sparsity_counts():
    hf = make_hf()
    ours = models_hf.ours_from(hf)
    assert ours.config.index_topk == 8 and ours.config.rope_interleaved
    ids = models_hf.tokens()
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        dense = Transformer(dataclasses.replace(ours.config, index_topk=64)).eval()
        dense.load_state_dict(ours.state_dict())
        assert (dense(ids) - got).abs().max() > 1e-3  # the selection changed the answer
        # the first 8 positions see at most 8 keys: dense there
        torch.testing.assert_close(dense(ids)[:, :8], got[:, :8], atol=ATOL, rtol=0)


def test_indexer_selects_transformers_keys():
    """The same inputs through transformers' DeepseekV32Indexer and ours: the same top-k
    keys for every query that sees more than k."""
    hf = make_hf()
    ours = models_hf.ours_from(hf)
    seen = {}
    layer = hf.model.layers[1].self_attn
    layer.indexer.register_forward_hook(lambda m, args, kwargs, out: seen.update(out=out, args=args,
                                        kwargs=kwargs), with_kwargs=True)  # fmt: skip
    ids = models_hf.tokens()
    with torch.no_grad():
        hf(ids)
        hidden, q_resid = seen["args"][:2] if len(seen["args"]) >= 2 else (
            seen["kwargs"]["hidden_states"], seen["kwargs"]["q_resid"])  # fmt: skip
        mla = ours.layers["1"].attention
        rope = (ours.rope_cos, ours.rope_sin)
        iq, weights = mla.indexer.queries(hidden, q_resid, rope, None)
        keys = mla.indexer.keys(hidden, rope, None)
        allowed = torch.ones(24, 24, dtype=torch.bool).tril()[None]
        scores = mla.indexer.scores(iq, weights, keys, allowed)
        index, _ = select_keys(scores, allowed, 8)
    want = seen["out"].long()
    for row in range(8, 24):  # queries with more than 8 keys in view
        assert set(index[:, row].flatten().tolist()) and all(
            set(index[b, row].tolist()) == set(want[b, row].tolist()) for b in range(2)
        ), row


def test_sparse_attention_equals_dense_attention_restricted_to_the_keys():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 10, 3, 8, generator=gen), torch.randn(2, 10, 3, 8, generator=gen)
    v = torch.randn(2, 10, 3, 6, generator=gen)
    allowed = torch.ones(10, 10, dtype=torch.bool).tril()[None]
    index, valid = select_keys(torch.randn(2, 10, 10, generator=gen).masked_fill(~allowed, -1e9),
                               allowed, 4)  # fmt: skip
    got = sparse_attention(q, k, v, index, valid, 0.3)
    chosen = torch.zeros(2, 10, 10, dtype=torch.bool).scatter_(-1, index, valid)
    scores = torch.einsum("bshd,bthd->bhst", q, k) * 0.3
    probs = scores.masked_fill(~chosen[:, None], float("-inf")).softmax(-1)
    torch.testing.assert_close(got, torch.einsum("bhst,bthd->bshd", probs, v), atol=1e-6, rtol=1e-5)
    assert int(chosen[0, 9].sum()) == 4 and int(chosen[0, 2].sum()) == 3  # 3 keys in view


def test_greedy_with_cache_matches_transformers():
    """32 tokens past the 8-key selection: the indexer's keys cached, the cache masked."""
    hf = make_hf()
    ours = models_hf.ours_from(hf)
    prompts = models_hf.prompts((11, 3))
    config = GenerationConfig(max_new_tokens=32)
    # One prompt at a time: a left-padded batch shifts the key positions, and keys whose
    # index scores tie (relu makes exact zeros common) may then be chosen otherwise.
    alone = [generate(ours, [p], config)[0] for p in prompts]
    for prompt, got in zip(prompts, alone, strict=True):
        assert got == models_hf.hf_greedy(hf, prompt)


def test_index_loss_trains_the_indexer_alone():
    model = Transformer(dataclasses.replace(build_model_config("deepseek_v32", "debug"),
                                            index_loss_scale=1.0))  # fmt: skip
    model.train()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    (model(ids).sum() * 0).backward()  # only the attached index loss has a gradient
    for name, p in model.named_parameters():
        if ".indexer." in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None or not p.grad.any(), name
    mla = model.layers["1"].attention
    assert mla.last_index_loss is not None and float(mla.last_index_loss) > 0
    # the loss itself: KL(head-averaged attention over the chosen keys || softmax(scores))
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 6, 2, 4, generator=gen), torch.randn(1, 6, 2, 4, generator=gen)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()[None]
    scores = torch.randn(1, 6, 6, generator=gen).masked_fill(~allowed, float("-inf"))
    index, valid = select_keys(scores, allowed, 3)
    got = index_kl_loss(q, k, 0.5, scores, index, valid)
    chosen = torch.zeros(1, 6, 6, dtype=torch.bool).scatter_(-1, index, valid)
    att = (torch.einsum("bshd,bthd->bhst", q, k) * 0.5).masked_fill(~chosen[:, None], float("-inf"))
    target = att.softmax(-1).mean(1)  # (1, 6, 6)
    log_q = scores.masked_fill(~chosen, float("-inf")).log_softmax(-1)
    want = torch.stack([
        F.kl_div(log_q[0, s][chosen[0, s]], target[0, s][chosen[0, s]], reduction="sum")
        for s in range(6)
    ]).mean()  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def _step_grads(micro_batches):
    """The indexer's and the rest's gradients of one trainer step (no clipping)."""
    from mindspeed_core.optim import OptimConfig
    from mindspeed_llm.train.build import build_model, build_train_parts
    from mindspeed_llm.train.objectives import NextToken
    from mindspeed_llm.train.step import TrainStep

    config = dataclasses.replace(build_model_config("deepseek_v32", "debug"), index_loss_scale=1.0)
    parallel = ParallelConfig()
    dims = parallel.dims(1).build("cpu")
    torch.manual_seed(0)
    built = build_model(config, dims, torch.device("cpu"), parallel=parallel, seq_len=16)
    parts = build_train_parts(built, OptimConfig(lr=1e-3, warmup_steps=0), total_steps=1)
    TrainStep(parts, NextToken(), dims, clip_grad=0.0)(micro_batches)
    return {n: p.grad.clone() for n, p in built.model.named_parameters() if p.grad is not None}


def test_index_loss_is_each_micro_batch_share_of_the_step():
    """The trainer scales the indexer loss each micro-batch attaches by its share of the
    step, like the model's other losses: two rows in one micro-batch or one row in each of
    two give the same gradients, the indexer's included."""
    from mindspeed_llm.data.collate import lm_batch, split_batch

    ids = torch.randint(8, 512, (2, 17), generator=torch.Generator().manual_seed(3))
    batch = lm_batch(ids, 7)
    halves = split_batch(batch, 2)
    whole, split = _step_grads([batch]), _step_grads(halves)
    assert any(".indexer." in name for name in whole)
    assert whole.keys() == split.keys()
    for name, grad in whole.items():
        torch.testing.assert_close(split[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_state_dict_round_trips_bit_identical():
    hf = make_hf()
    config = TransformerConfig.from_hf(hf.config.to_dict())
    adapter = get_model_spec("deepseek_v32").hf_adapter
    ours = adapter.from_hf(hf.state_dict(), config)
    assert ours.keys() == Transformer(config).state_dict().keys()
    back = adapter.to_hf(ours, config)
    assert torch.equal(back["model.layers.2.self_attn.indexer.k_norm.bias"],
                       hf.state_dict()["model.layers.2.self_attn.indexer.k_norm.bias"])  # fmt: skip
    again = adapter.from_hf(back, config)
    for name, tensor in ours.items():
        assert torch.equal(again[name], tensor), name


def test_config_and_layouts():
    v5 = make_hf().config.to_dict()
    config = TransformerConfig.from_hf(v5)
    assert TransformerConfig.from_hf(config.to_hf_dict()) == config
    with pytest.raises(ConfigError, match="layer_types"):
        TransformerConfig.from_hf({**v5, "layer_types": ["indexed_attention", "full", "full"]})
    with pytest.raises(ConfigError, match="needs q_lora_rank"):
        TransformerConfig.from_hf({**v5, "q_lora_rank": None})
    with pytest.raises(ConfigError, match="index_head_dim=8 must exceed"):
        dataclasses.replace(config, index_head_dim=8)
    debug = build_model_config("deepseek_v32", "debug")
    check_layout(debug, ParallelConfig(ep=2, dp_shard=2))
    check_layout(debug, ParallelConfig(tp=2))
    with pytest.raises(LayoutError, match="cp=2: DeepSeek"):
        check_layout(debug, ParallelConfig(cp=2), flag="{}")


def _tp():
    families = import_sibling(__file__, "test_models_families")
    return families._step("deepseek_v32", {"index_loss_scale": 1.0}, {"sequence_parallel": True})


@pytest.mark.distributed
def test_tp2_sp_matches_one_process_with_the_index_loss():
    """Heads split over tp, the indexer whole on each rank (same choice), its KL target
    summed over the ranks' heads: logits, loss and every gradient (the indexer's included)."""
    families = import_sibling(__file__, "test_models_families")
    ranks = run_distributed(_tp, 2, timeout=300)
    ref = families._step("deepseek_v32", {"index_loss_scale": 1.0})
    assert any(".indexer." in k and v.abs().sum() > 0 for k, v in ref.items())
    for result in ranks:
        assert result.keys() == ref.keys()
        for key, value in ref.items():
            torch.testing.assert_close(result[key], value, atol=ATOL, rtol=0, msg=key)
