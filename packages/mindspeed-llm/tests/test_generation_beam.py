"""Beam search equals transformers' `generate(num_beams=...)`: the same beams (tokens) and
the same scores (fp32, 1e-5), under each early-stopping rule and length penalty, with stop
tokens met mid-search; a left-padded batch equals one prompt at a time; bad settings refused."""

import pytest
import torch

from mindspeed_core.errors import ConfigError
from mindspeed_core.testing import import_sibling
from mindspeed_llm.generation import GenerationConfig, TokenSteps, generate

hf_models = import_sibling(__file__, "models_hf")
NEW = 10


@pytest.fixture(scope="module")
def pair():
    hf = hf_models.make_hf("llama")
    return hf, hf_models.ours_from(hf)


def _prompts(lengths, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]


def _hf_beams(hf, prompt, beams, stops, **kwargs):
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=beams,
                      num_return_sequences=beams, max_new_tokens=NEW, eos_token_id=list(stops),
                      pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                      **kwargs)  # fmt: skip
    tokens = []
    for row in out.sequences[:, len(prompt):].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        tokens.append(row[:end])  # a stopped beam ends on its stop token; the rest is padding
    return tokens, out.sequences_scores.tolist()


def _stop_tokens(ours, prompt):
    """Two tokens the beams meet in the middle of the search, so beams finish early."""
    steps = TokenSteps(ours, [prompt], GenerationConfig(max_new_tokens=NEW, num_beams=4))
    for _ in steps:
        pass
    best = steps.beams[0][0].tokens
    return {best[1], best[6]}


@pytest.mark.parametrize(
    ("early_stopping", "length_penalty"),
    [(False, 1.0), (True, 1.0), ("never", 0.5), (False, -0.5)],
)
def test_beams_and_scores_equal_transformers(pair, early_stopping, length_penalty):
    hf, ours = pair
    for prompt in _prompts([7, 12]):
        stops = _stop_tokens(ours, prompt)
        config = GenerationConfig(max_new_tokens=NEW, num_beams=4, num_return_sequences=4,
                                  stop_token_ids=tuple(stops), early_stopping=early_stopping,
                                  length_penalty=length_penalty)  # fmt: skip
        steps = TokenSteps(ours, [prompt], config)
        for _ in steps:
            pass
        tokens, scores = _hf_beams(hf, prompt, 4, stops, early_stopping=early_stopping,
                                   length_penalty=length_penalty)  # fmt: skip
        assert steps.outputs == tokens
        assert any(len(t) < NEW for t in tokens)  # some beams stopped on a stop token
        torch.testing.assert_close([b.score for b in steps.beams[0]], scores, rtol=1e-5, atol=1e-5)


def test_a_left_padded_batch_equals_one_prompt_at_a_time(pair):
    _, ours = pair
    prompts = _prompts([3, 11, 6])
    config = GenerationConfig(max_new_tokens=NEW, num_beams=3, num_return_sequences=2,
                              stop_token_ids=(7, 100))  # fmt: skip
    alone = [generate(ours, [p], config) for p in prompts]
    assert generate(ours, prompts, config) == [row for rows in alone for row in rows]
    assert generate(ours, prompts[:1], config.replace(num_return_sequences=1)) == alone[0][:1]


def test_bad_beam_settings_are_refused():
    cases = {
        (("num_beams", 0),): "num_beams must be at least 1",
        (("num_beams", 2), ("num_return_sequences", 3)): "num_return_sequences=3 exceeds num_beams=2",
        (("num_beams", 2), ("temperature", 0.7)): "beam search here is deterministic",
        (("num_beams", 2), ("early_stopping", "sometimes")): "early_stopping must be true, false",
        (("length_penalty", float("nan")),): "length_penalty must be finite",
    }
    for fields, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            GenerationConfig(**dict(fields))


def test_beam_settings_from_generation_config_json(tmp_path):
    import json

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"num_beams": 3, "length_penalty": 0.5, "early_stopping": True, "max_new_tokens": 7}))  # fmt: skip
    config = GenerationConfig.from_file(tmp_path)
    assert (config.num_beams, config.length_penalty, config.early_stopping) == (3, 0.5, True)
    # a sampling file keeps sampling (beam sampling is not built), its beams ignored
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"num_beams": 3, "do_sample": True, "temperature": 0.7}))  # fmt: skip
    config = GenerationConfig.from_file(tmp_path)
    assert (config.num_beams, config.temperature) == (1, 0.7)
