"""One tokenizer interface over sentencepiece and Hugging Face tokenizer.json files."""

import json

import pytest

from mindspeed_core.errors import DataError
from mindspeed_llm.tokenizer import (
    HFTokenizer,
    SentencePieceTokenizer,
    load_tokenizer,
    train_sentencepiece,
)

TEXTS = [
    f"{name} has {n} {thing} in the {place}; {n} plus {m} is {n + m}."
    for name in ("alice", "bob", "carol", "dave")
    for thing in ("apples", "books", "stones")
    for place in ("garden", "kitchen", "market")
    for n, m in ((1, 2), (3, 4), (5, 6))
]
UNSEEN = "Zoë's café: 你好, 🙂  two  spaces\tand a tab"


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return train_sentencepiece(TEXTS, tmp_path_factory.mktemp("sp") / "tok", 320)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<|begin_of_text|>", "<|endoftext|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS, trainer=trainer)
    tok.add_special_tokens(["<|extra_0|>"])  # added after the model vocab, as Qwen's are
    folder = tmp_path_factory.mktemp("hf")
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_sentencepiece_round_trip_and_special_ids(sp_model):
    tok = load_tokenizer(sp_model)
    assert isinstance(tok, SentencePieceTokenizer) and tok.vocab_size == 320
    assert (tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id, tok.eod_id) == (0, 1, 2, 3, 2)
    assert tok.special_tokens == {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    for text in TEXTS[:5] + [UNSEEN, ""]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text  # byte fallback and identity normalisation
    ids = tok.encode(TEXTS[0], add_bos=True, add_eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and ids[1:-1] == tok.encode(TEXTS[0])
    assert tok.decode(ids) == TEXTS[0]
    assert len(tok.encode(TEXTS[0])) < 0.7 * len(TEXTS[0])  # it learned pieces, not bytes
    assert tok.token_to_id("</s>") == 2 and tok.token_to_id("no-such-piece") is None


def test_sentencepiece_training_is_deterministic(sp_model, tmp_path):
    again = train_sentencepiece(TEXTS, tmp_path / "again", 320)
    assert again.read_bytes() == sp_model.read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["again.model"]  # no temporary left
    with pytest.raises(DataError, match=rf"{tmp_path / 'big'}\.model.*Vocabulary size"):
        train_sentencepiece(TEXTS, tmp_path / "big", 100_000)


def test_hf_tokenizer_json_through_the_same_interface(hf_dir):
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer)
    vocab = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["vocab"]
    assert tok.vocab_size == len(vocab) + 1 > 300
    assert tok.token_to_id("<|extra_0|>") == len(vocab)
    ids = {t: tok.token_to_id(t) for t in ("<unk>", "<|begin_of_text|>", "<|endoftext|>")}
    assert (tok.unk_id, tok.bos_id, tok.eos_id) == tuple(ids.values())
    assert tok.pad_id == tok.eod_id == tok.eos_id  # no pad token: falls back to eos
    assert set(tok.special_tokens) == {
        "<unk>",
        "<|begin_of_text|>",
        "<|endoftext|>",
        "<|im_end|>",
        "<|extra_0|>",
    }
    for text in TEXTS[:5] + [UNSEEN]:
        assert tok.decode(tok.encode(text)) == text
    framed = tok.encode(TEXTS[1], add_bos=True, add_eos=True)
    assert framed[0] == tok.bos_id and framed[-1] == tok.eos_id
    assert tok.decode(framed) == TEXTS[1]  # special tokens are left out
    assert tok.token_to_id("no-such-piece") is None
    assert load_tokenizer(hf_dir / "tokenizer.json").vocab_size == tok.vocab_size


def test_hf_config_names_the_special_tokens(hf_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    config = {
        "eos_token": {"content": "<|im_end|>"},
        "pad_token": "<|endoftext|>",
        "bos_token": None,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert tok.eos_id == tok.token_to_id("<|im_end|>")
    assert tok.pad_id == tok.token_to_id("<|endoftext|>")
    assert tok.bos_id is None
    with pytest.raises(DataError, match=rf"{tmp_path / 'tokenizer.json'} defines no bos"):
        tok.encode("x", add_bos=True)


def test_folder_with_a_model_file(sp_model, tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(sp_model.read_bytes())
    assert isinstance(load_tokenizer(tmp_path), SentencePieceTokenizer)


def test_bad_paths(tmp_path):
    with pytest.raises(DataError, match="not a local path.*huggingface-cli download"):
        load_tokenizer("meta-llama/Llama-2-7b")
    with pytest.raises(DataError, match=rf"does not exist: {tmp_path / 'nope'}"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(DataError, match=rf"no tokenizer in {tmp_path}"):
        load_tokenizer(tmp_path)
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    with pytest.raises(DataError, match=rf"unknown tokenizer file {tmp_path / 'vocab.txt'}"):
        load_tokenizer(tmp_path / "vocab.txt")
    (tmp_path / "broken.model").write_bytes(b"not a model")
    with pytest.raises(
        DataError, match=rf"cannot read sentencepiece model {tmp_path / 'broken.model'}"
    ):
        load_tokenizer(tmp_path / "broken.model")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(
        DataError, match=rf"cannot read tokenizer file {tmp_path / 'tokenizer.json'}"
    ):
        load_tokenizer(tmp_path)
