"""Generation under tensor parallel (2 gloo ranks, one spawn): greedy equals transformers
with and without the KV cache, a left-padded batch equals one process, and sampling (seeded
or not) draws the same tokens on every rank."""

import pytest
import torch

from mindspeed_core.parallel import ParallelDims
from mindspeed_core.testing import import_sibling, run_distributed
from mindspeed_llm.generation import GenerationConfig, generate
from mindspeed_llm.models import get_model_spec

hf_models = import_sibling(__file__, "models_hf")
NEW = 32
PROMPTS = [[5, 99, 3, 250, 17, 8, 41], [300, 2, 77]]


def _greedy(model):
    return {
        "cache": generate(model, PROMPTS, GenerationConfig(max_new_tokens=NEW)),
        "no_cache": generate(model, PROMPTS, GenerationConfig(max_new_tokens=NEW, use_cache=False)),
    }


def _sampled(model):
    config = GenerationConfig(max_new_tokens=16, temperature=1.2, top_k=20, top_p=0.9)
    return {
        "seeded": generate(model, PROMPTS, config.replace(seed=3)),
        "unseeded": generate(model, PROMPTS, config),
    }


def _tp_rank():
    results = {}
    for case in ("llama", "qwen3"):
        model = hf_models.ours_from(hf_models.make_hf(case))
        get_model_spec(model.config.family).parallelize(model, ParallelDims(tp=2).build())
        weight = model.layers["0"].attention.wk.weight
        assert weight.to_local().shape[0] == weight.shape[0] // 2  # really sharded
        results[case] = {**_greedy(model), **_sampled(model)}
    return results


@pytest.mark.distributed
def test_tp2_generation_matches_one_process_and_transformers():
    ranks = run_distributed(_tp_rank, 2, timeout=300)
    assert ranks[0] == ranks[1]  # every rank draws the same tokens, seeded or not
    for case, got in ranks[0].items():
        hf = hf_models.make_hf(case)
        ours = hf_models.ours_from(hf)
        for prompt, cached, uncached in zip(PROMPTS, got["cache"], got["no_cache"], strict=True):
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
            assert cached == expected, case
            assert uncached == expected, case
        assert got["seeded"] == _sampled(ours)["seeded"], case
