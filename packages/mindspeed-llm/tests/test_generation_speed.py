"""Decoding for rollouts and evaluation: a batch of 32 prompts of mixed lengths decodes
what each prompt decodes alone (greedy); n samples per prompt sharing one prefill draw
what the prompt repeated n times draws (same seed); compiled blocks decode the eager
tokens; int8 weight-only layers compute with the dequantized weights, per output channel,
and keep the model's logits close to fp32's."""

import pytest
import torch

from mindspeed_core.errors import ConfigError
from mindspeed_core.parallel.compile import is_compiled
from mindspeed_llm.generation import GenerationConfig, generate
from mindspeed_llm.generation.quantize import Int8Linear, quantize_int8, quantize_weights
from mindspeed_llm.models import build_model_config, get_model_spec


def _model():
    torch.manual_seed(0)
    config = build_model_config("llama", flavor="debug")
    return get_model_spec("llama").build(config).eval()


def _prompts(n, seed=5):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 24, (n,), generator=gen).tolist()
    return [torch.randint(0, 512, (k,), generator=gen).tolist() for k in lengths]


def test_batch_of_32_greedy_equals_each_prompt_alone():
    model, prompts = _model(), _prompts(32)
    config = GenerationConfig(max_new_tokens=8)
    assert generate(model, prompts, config) == [generate(model, [p], config)[0] for p in prompts]


def test_n_samples_share_one_prefill_and_draw_as_repeated_prompts():
    model, prompts = _model(), _prompts(3)
    config = GenerationConfig(max_new_tokens=10, temperature=1.0, top_k=0, seed=11)
    shared = generate(model, prompts, config.replace(num_return_sequences=4))
    repeated = generate(model, [p for p in prompts for _ in range(4)], config)
    assert shared == repeated and len(shared) == 12
    assert len({tuple(s) for s in shared[:4]}) > 1  # the 4 samples of a prompt differ
    greedy = generate(model, prompts, GenerationConfig(max_new_tokens=6, num_return_sequences=2))
    assert (
        greedy[0::2] == greedy[1::2] == generate(model, prompts, GenerationConfig(max_new_tokens=6))
    )
    with pytest.raises(ConfigError, match="num_return_sequences"):
        GenerationConfig(num_return_sequences=0)


def test_compiled_decoding_gives_the_eager_tokens():
    model, prompts = _model(), _prompts(3)
    config = GenerationConfig(max_new_tokens=12)
    eager = generate(model, prompts, config)
    assert generate(model, prompts, config.replace(compile=True)) == eager
    assert all(is_compiled(block) for block in model.layers.values())


def test_int8_linear_is_the_dequantized_weight_per_channel():
    torch.manual_seed(1)
    linear = torch.nn.Linear(64, 96, bias=False)
    linear.weight.data[3] *= 50  # an outlier row must not coarsen the other rows' scale
    q, scale = quantize_int8(linear.weight)
    assert q.dtype == torch.int8 and scale.shape == (96,)
    err = (q.float() * scale[:, None] - linear.weight).abs().max(dim=1).values
    assert torch.all(err <= scale / 2 + 1e-7)  # round to nearest, row by row
    x = torch.randn(3, 5, 64)
    want = x @ (q.float() * scale[:, None]).t()
    torch.testing.assert_close(Int8Linear(linear)(x), want, rtol=1e-5, atol=1e-5)


def test_int8_and_bf16_models_stay_close_to_fp32():
    model, tokens = _model(), torch.randint(0, 512, (2, 16), generator=torch.Generator())
    with torch.no_grad():
        want = model(tokens)
        bf16 = _model().to(torch.bfloat16)(tokens).float()
        int8 = quantize_weights(_model())
        assert sum(isinstance(m, Int8Linear) for m in int8.modules()) == 2 * 7 + 1
        got = int8(tokens)
    scale = want.abs().max()
    assert (got - want).abs().max() / scale < 0.02
    assert (bf16 - want).abs().max() / scale < 0.05
    dequantized = _model()  # the same weights, rounded as int8 would round them, in fp32
    with torch.no_grad():
        for module in dequantized.modules():
            if isinstance(module, torch.nn.Linear):
                q, scale = quantize_int8(module.weight)
                module.weight.copy_(q.float() * scale[:, None])
    config = GenerationConfig(max_new_tokens=8)
    assert generate(int8, _prompts(4), config) == generate(dequantized, _prompts(4), config)
