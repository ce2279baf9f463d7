"""Continuous batching (`DecodeBatch`): rows that join a running batch between steps, with
prompts shorter and longer than what the batch has decoded so far, and rows that leave
early, each decode exactly the greedy tokens they decode alone (KV cache rows aligned by
`KVCache.concat`, positions per row, sliding windows over real positions)."""

import pytest
import torch

from mindspeed_core.errors import DataError
from mindspeed_core.testing import import_sibling
from mindspeed_llm.generation import GenerationConfig, generate
from mindspeed_llm.generation.batching import DecodeBatch

hf_models = import_sibling(__file__, "models_hf")


def _prompts(lengths, seed=11):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("case", ["llama", "mistral-window"])
def test_rows_joining_and_leaving_decode_what_they_decode_alone(case):
    model = hf_models.ours_from(hf_models.make_hf(case))
    prompts = dict(zip("abcde", _prompts([4, 19, 2, 9, 30]), strict=True))
    budgets = {"a": 14, "b": 6, "c": 12, "d": 3, "e": 9}
    joins = {0: "a", 2: "bc", 5: "d", 9: "e"}  # step -> rows that join before it
    batch, out, last = DecodeBatch(model), {k: [] for k in prompts}, {}
    for step in range(40):
        if step in joins:
            ids = list(joins[step])
            logits = batch.join(ids, [prompts[i] for i in ids], [budgets[i] for i in ids])
            for i, token in zip(ids, logits.argmax(-1).tolist(), strict=True):
                out[i].append(token)
                last[i] = token
        done = [i for i in batch.ids if len(out[i]) == budgets[i]]
        batch.leave(done)
        for i in done:
            del last[i]
        if not batch.ids:
            if step > max(joins):
                break
            continue
        logits = batch.step(last)
        for i, token in zip(batch.ids, logits.argmax(-1).tolist(), strict=True):
            out[i].append(token)
            last[i] = token
    for i, prompt in prompts.items():
        alone = generate(model, [prompt], GenerationConfig(max_new_tokens=budgets[i]))[0]
        assert out[i] == alone, i


def test_a_prompt_that_does_not_fit_is_refused():
    model = hf_models.ours_from(hf_models.make_hf("llama"))
    context = model.config.max_position_embeddings
    with pytest.raises(DataError, match=f"do not fit the model's context of {context}"):
        DecodeBatch(model).join(["x"], [[5] * (context - 3)], [4])
