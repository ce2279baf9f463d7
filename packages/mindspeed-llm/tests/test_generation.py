"""Generation: greedy equals transformers token for token (fp32, with and without the KV
cache), left-padded batches equal one-by-one runs, sampling filters equal transformers'
logits processors and only ever pick allowed tokens, stop tokens and stop strings (no
partial match leaks into streamed text), generation_config.json defaults."""

import json

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from mindspeed_core.errors import ConfigError, DataError
from mindspeed_core.testing import import_sibling
from mindspeed_llm.generation import (
    GenerationConfig,
    Generator,
    TextStream,
    generate,
    load_generation_config,
    process_logits,
)
from mindspeed_llm.generation.sampling import apply_repetition_penalty
from mindspeed_llm.tokenizer import load_tokenizer

hf_models = import_sibling(__file__, "models_hf")
NEW = 32


def _prompts(lengths, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]


def _hf_greedy(hf, prompt, **kwargs):
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        eos_token_id=None,
        pad_token_id=0,
        **kwargs,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def pairs():
    built = {}

    def get(case):
        if case not in built:
            hf = hf_models.make_hf(case)
            built[case] = hf, hf_models.ours_from(hf)
        return built[case]

    return get


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no_cache"])
@pytest.mark.parametrize("case", ["llama", "qwen3", "mistral-window"])
def test_greedy_matches_transformers(pairs, case, use_cache):
    hf, ours = pairs(case)
    prompts = _prompts([11, 5])
    config = GenerationConfig(max_new_tokens=NEW, use_cache=use_cache)
    got = generate(ours, prompts, config)
    assert got == [_hf_greedy(hf, p) for p in prompts]


def test_repetition_penalty_greedy_matches_transformers(pairs):
    hf, ours = pairs("llama")
    prompt = _prompts([9])[0]
    config = GenerationConfig(max_new_tokens=NEW, repetition_penalty=1.3)
    assert generate(ours, [prompt], config)[0] == _hf_greedy(hf, prompt, repetition_penalty=1.3)


def test_left_padded_batch_equals_one_by_one(pairs):
    _, ours = pairs("qwen3")
    prompts = _prompts([3, 14, 8, 1])
    for config in (
        GenerationConfig(max_new_tokens=20),
        GenerationConfig(max_new_tokens=20, repetition_penalty=1.2),
        GenerationConfig(max_new_tokens=20, use_cache=False),
    ):
        alone = [generate(ours, [p], config)[0] for p in prompts]
        assert generate(ours, prompts, config) == alone, config
    _, windowed = pairs("mistral-window")  # the window counts real positions, not padding
    config = GenerationConfig(max_new_tokens=12)
    assert generate(windowed, prompts, config) == [
        generate(windowed, [p], config)[0] for p in prompts
    ]


def test_repetition_penalty_equals_transformers_processor():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 3
    ids = torch.randint(0, 50, (3, 12), generator=gen)
    seen = torch.zeros(3, 50, dtype=torch.bool).scatter_(1, ids, True)
    for penalty in (1.3, 0.7):
        expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
        torch.testing.assert_close(apply_repetition_penalty(logits, seen, penalty), expected)


def test_sampling_filters_equal_transformers_warpers():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 200, generator=gen) * 2
    ids = torch.randint(0, 200, (4, 5), generator=gen)
    seen = torch.zeros(4, 200, dtype=torch.bool).scatter_(1, ids, True)
    for temperature, top_k, top_p, penalty in [
        (0.7, 10, 1.0, 1.0),
        (1.3, 0, 0.8, 1.0),
        (0.9, 50, 0.5, 1.2),
        (1.0, 1, 0.3, 1.0),
    ]:
        config = GenerationConfig(
            temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=penalty
        )
        expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
        expected = TemperatureLogitsWarper(temperature)(ids, expected)
        if top_k:
            expected = TopKLogitsWarper(top_k)(ids, expected)
        expected = TopPLogitsWarper(top_p)(ids, expected) if top_p < 1 else expected
        torch.testing.assert_close(process_logits(logits, config, seen), expected)


@pytest.mark.parametrize(
    "filters", [{"top_k": 3}, {"top_k": 0, "top_p": 0.3}], ids=["top_k", "top_p"]
)
def test_sampling_only_picks_allowed_tokens(pairs, filters):
    _, ours = pairs("llama")
    prompts = _prompts([6, 6])
    config = GenerationConfig(max_new_tokens=24, temperature=1.5, seed=7, **filters)
    out = generate(ours, prompts, config)
    assert out == generate(ours, prompts, config)  # same seed, same tokens
    assert out != generate(ours, prompts, config.replace(seed=8))
    greedy = generate(ours, prompts, GenerationConfig(max_new_tokens=24))
    assert out != greedy  # it does sample
    with torch.no_grad():
        for prompt, new in zip(prompts, out, strict=True):
            logits = ours(torch.tensor([prompt + new]))[0, len(prompt) - 1 : -1]
            allowed = torch.isfinite(process_logits(logits, config, None))
            assert allowed.sum(-1).max() < 512 and allowed.sum(-1).min() >= 1
            assert allowed[torch.arange(len(new)), torch.tensor(new)].all()


def test_stop_token_ends_a_row_and_stream_sees_every_token(pairs):
    _, ours = pairs("llama")
    prompts = _prompts([7, 4])
    free = generate(ours, prompts, GenerationConfig(max_new_tokens=16))
    stop = free[0][5]
    cut = free[0].index(stop) + 1
    streamed = []
    out = generate(
        ours,
        prompts,
        GenerationConfig(max_new_tokens=16, stop_token_ids=[stop]),
        stream=lambda row, token: streamed.append((row, token)),
    )
    assert out[0] == free[0][:cut] and out[0][-1] == stop
    assert out[1] == (free[1][: free[1].index(stop) + 1] if stop in free[1] else free[1])
    assert [t for r, t in streamed if r == 0] == out[0]
    assert [t for r, t in streamed if r == 1] == out[1]
    # a true return from the callback ends that row
    out = generate(ours, prompts, GenerationConfig(max_new_tokens=16), stream=lambda r, t: r == 1)
    assert out == [free[0], free[1][:1]]


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no_cache"])
def test_finished_rows_leave_the_batch(pairs, use_cache):
    """Rows ended early (by the stream callback here) are dropped from the decode batch once a
    quarter of it has finished; the other rows decode exactly what they decode alone."""
    _, ours = pairs("llama")
    prompts = _prompts([7, 4, 9, 3, 6, 5, 8, 2])
    config = GenerationConfig(max_new_tokens=12, use_cache=use_cache)
    alone = [generate(ours, [p], config)[0] for p in prompts]
    stops, counts, sizes = {0: 2, 3: 2, 5: 4}, {}, []  # row -> new tokens after which it ends

    def stream(row, token):
        counts[row] = counts.get(row, 0) + 1
        return counts[row] == stops.get(row)

    hook = ours.register_forward_pre_hook(lambda module, args: sizes.append(args[0].shape[0]))
    try:
        out = generate(ours, prompts, config, stream=stream)
    finally:
        hook.remove()
    for row, tokens in enumerate(out):
        assert tokens == alone[row][: stops.get(row, 12)], row
    if use_cache:  # prefill and first decode of 8 rows, then 6 (two ended), then 5
        assert sizes == [8, 8, 6, 6] + [5] * 8, sizes


def _pieces(*pieces):
    return lambda ids: "".join(pieces[i] for i in ids)


def test_text_stream_holds_back_partial_stop_strings():
    decode = _pieces("ab", "ST", "O", "x", "OP", "\ufffd", "é")
    stream = TextStream(decode, ["STOP"])
    assert [stream.push(t) for t in (0, 1, 2)] == ["ab", "", ""]  # "ST", "STO" could stop
    assert stream.push(3) == "STOx" and not stream.stopped  # it did not
    stream = TextStream(decode, ["STOP"])
    chunks = [stream.push(t) for t in (0, 1, 4)]
    assert chunks == ["ab", "", ""] and stream.stopped and stream.text == "ab"
    assert stream.flush() == ""
    stream = TextStream(decode, ["STOP", "Ox"])  # the earliest match wins
    assert "".join(stream.push(t) for t in (0, 1, 2, 3)) == "abST" and stream.stopped
    stream = TextStream(decode, [])  # an unfinished UTF-8 character waits
    assert stream.push(0) == "ab" and stream.push(5) == "" and stream.flush() == "\ufffd"


def _word_tokenizer(folder):
    """A 512-word WordLevel tokenizer.json with <s> = 0 and </s> = 1 (no network)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, 512)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    return load_tokenizer(folder)


def test_generator_stop_strings_and_streaming(pairs, tmp_path):
    _, ours = pairs("llama")
    gen = Generator(ours, _word_tokenizer(tmp_path), GenerationConfig(max_new_tokens=12))
    prompt = "w10 w20 w30"
    assert gen.encode(prompt) == [0, 10, 20, 30] == gen.encode("<s>w10 w20 w30")
    full = gen.generate([prompt])[0]
    words = full.split()
    assert len(words) == 12 and full == " ".join(words)
    stop = f" {words[4]} {words[5]}"
    cut = full.index(stop)
    assert gen.generate([prompt], stop_strings=[stop]) == [full[:cut]]
    assert "".join(gen.stream(prompt, stop_strings=[stop])) == full[:cut]
    # a stop string that starts to match and never completes: held back, then released
    never = f" {words[4]} zzz"
    chunks = list(gen.stream(prompt, stop_strings=[never]))
    assert "".join(chunks) == full
    assert all(not c.endswith(f" {words[4]}") for c in chunks)  # never released alone
    assert gen.generate([prompt, "w7"], stop_strings=[stop])[0] == full[:cut]
    done = gen.complete([prompt, [0, 10, 20, 30]], stop_strings=[stop])
    assert done[0] == done[1] and done[0].text == full[:cut] and done[0].finish_reason == "stop"
    assert gen.complete([prompt])[0].finish_reason == "length"
    assert gen.tokenizer.decode(done[0].token_ids).startswith(full[:cut] + stop)


def test_generation_config_from_file(tmp_path):
    path = tmp_path / "generation_config.json"
    path.write_text(
        json.dumps(
            {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [1, 2],
             "max_new_tokens": 7, "transformers_version": "4.45"}
        )
    )  # fmt: skip
    config = GenerationConfig.from_file(tmp_path)
    assert (config.temperature, config.top_k, config.top_p) == (0.6, 50, 0.9)
    assert config.stop_token_ids == (1, 2) and config.max_new_tokens == 7
    assert GenerationConfig.from_file(path, temperature=0, top_k=None).greedy
    path.write_text(json.dumps({"temperature": 0.6, "eos_token_id": 2, "repetition_penalty": 1.1}))
    config = load_generation_config(tmp_path)
    assert config.greedy and config.stop_token_ids == (2,) and config.repetition_penalty == 1.1
    assert load_generation_config(tmp_path / "nowhere", max_new_tokens=3) == GenerationConfig(
        max_new_tokens=3
    )
    path.write_text(json.dumps({"do_sample": True, "top_p": 1.5}))
    with pytest.raises(ConfigError, match="generation_config.json.*top_p"):
        GenerationConfig.from_file(path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        GenerationConfig.from_file(path)


def test_generator_uses_generation_config_defaults(pairs, tmp_path):
    _, ours = pairs("llama")
    tok = _word_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    gen = Generator(ours, tok, load_generation_config(tmp_path))
    assert len(gen.generate(["w5"])[0].split()) == 3
    assert gen.resolved_config().stop_token_ids == (tok.eos_id,)


def test_bad_prompts_and_settings(pairs):
    _, ours = pairs("llama")
    with pytest.raises(DataError, match="prompt 1 is empty"):
        generate(ours, [[1], []])
    with pytest.raises(DataError, match="token id 512"):
        generate(ours, [[1, 512]])
    with pytest.raises(DataError, match="context of 256"):
        generate(ours, [[1] * 256])
    assert len(generate(ours, [[1] * 250], GenerationConfig(max_new_tokens=50))[0]) == 6
    for bad in ({"temperature": -1}, {"top_p": 0}, {"max_new_tokens": 0}, {"top_k": -2}):
        with pytest.raises(ConfigError):
            GenerationConfig(**bad)


def test_training_forward_is_unchanged(pairs):
    """The cache argument is opt-in: the same tokens give the same logits either way."""
    from mindspeed_llm.generation import KVCache

    _, ours = pairs("qwen3")
    tokens = torch.tensor(_prompts([10, 10]))
    with torch.no_grad():
        plain = ours(tokens)
        cache = KVCache.for_model(ours, 2, 16)
        cache.reset()
        cached = ours(tokens, position_ids=torch.arange(10).expand(2, 10), kv_cache=cache)
        last = ours(tokens, logits_to_keep=1)
    assert cache.offset == 10
    torch.testing.assert_close(cached, plain, atol=1e-5, rtol=0)
    torch.testing.assert_close(last, plain[:, -1:], atol=1e-5, rtol=0)
