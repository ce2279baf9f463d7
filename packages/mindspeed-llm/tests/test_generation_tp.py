"""Generation under tensor parallel (2 gloo ranks, one spawn): greedy equals transformers
(Llama with and without the KV cache, Qwen3's replicated qk-norms with it; MiniMax-M2's
sharded norm over all heads, slow) on a left-padded
batch, and sampling (seeded or not) draws the same tokens on every rank, seeded the same
as one process."""

import pytest
import torch

from mindspeed_core.parallel import ParallelDims
from mindspeed_core.testing import import_sibling, run_distributed
from mindspeed_llm.generation import GenerationConfig, generate
from mindspeed_llm.models import get_model_spec

hf_models = import_sibling(__file__, "models_hf")
NEW = 32
PROMPTS = [[5, 99, 3, 250, 17, 8, 41], [300, 2, 77]]


def _greedy(model, use_cache=True):
    return generate(model, PROMPTS, GenerationConfig(max_new_tokens=NEW, use_cache=use_cache))


def _sampled(model):
    config = GenerationConfig(max_new_tokens=16, temperature=1.2, top_k=20, top_p=0.9)
    return {
        "seeded": generate(model, PROMPTS, config.replace(seed=3)),
        "unseeded": generate(model, PROMPTS, config),
    }


def _tp_rank(cases=("llama", "qwen3")):
    results = {}
    for case in cases:
        model = hf_models.ours_from(hf_models.make_hf(case))
        get_model_spec(model.config.family).parallelize(model, ParallelDims(tp=2).build())
        weight = model.layers["0"].attention.wk.weight
        assert weight.to_local().shape[0] == weight.shape[0] // 2  # really sharded
        results[case] = {"cache": _greedy(model)}
        if case == "llama":
            results[case].update(no_cache=_greedy(model, use_cache=False), **_sampled(model))
    return results


@pytest.mark.distributed
def test_tp2_generation_matches_one_process_and_transformers():
    ranks = run_distributed(_tp_rank, 2, timeout=300)
    _assert_greedy_is_transformers(ranks)
    ours = hf_models.ours_from(hf_models.make_hf("llama"))
    assert ranks[0]["llama"]["seeded"] == _sampled(ours)["seeded"]


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_generation_with_a_norm_over_all_heads_matches_transformers():
    """MiniMax-M2: q/k norm weights sharded over tp, the squares summed over the ranks."""
    ranks = run_distributed(_tp_rank, 2, ("minimax_m2",), timeout=300)
    _assert_greedy_is_transformers(ranks)


def _assert_greedy_is_transformers(ranks):
    assert ranks[0] == ranks[1]  # every rank draws the same tokens, seeded or not
    for case, got in ranks[0].items():
        hf = hf_models.make_hf(case)
        for row, prompt in enumerate(PROMPTS):
            ids = torch.tensor([prompt])
            expected = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
            assert got["cache"][row] == expected, case
            if "no_cache" in got:
                assert got["no_cache"][row] == expected, case


ODD = {"vocab_size": 777, "tie_word_embeddings": True}


def _odd_tp_rank():
    model = hf_models.ours_from(hf_models.make_hf("llama", **ODD))
    get_model_spec("llama").parallelize(model, ParallelDims(tp=2).build())
    assert model.tok_embeddings.weight.shape[0] == 1024  # padded, 777 real rows
    return {"greedy": _greedy(model), **_sampled(model)}


@pytest.mark.slow
@pytest.mark.distributed
def test_a_tied_odd_vocabulary_generates_under_tp2_as_transformers():
    """vocab 777 padded to 1024 rows under tp=2: greedy equals transformers, sampling
    equals one process, and no padding id is ever drawn."""
    ranks = run_distributed(_odd_tp_rank, 2, timeout=300)
    assert ranks[0] == ranks[1]
    hf = hf_models.make_hf("llama", **ODD)
    for row, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        expected = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
            min_new_tokens=NEW, eos_token_id=None, pad_token_id=0,
        )[0, len(prompt) :].tolist()  # fmt: skip
        assert ranks[0]["greedy"][row] == expected
    one = _sampled(hf_models.ours_from(hf))
    assert ranks[0]["seeded"] == one["seeded"]
    drawn = [t for rows in (ranks[0]["seeded"], ranks[0]["unseeded"]) for r in rows for t in r]
    assert max(drawn) < 777
