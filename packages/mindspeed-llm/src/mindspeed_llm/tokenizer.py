"""Tokenizers: sentencepiece `.model` files and Hugging Face `tokenizer.json`, one face.

`load_tokenizer(path)` takes a file or a model directory (as downloaded from the
hub) and returns a `Tokenizer`. Nothing is fetched over the network: a hub name
gets a message asking for a local path.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path

from mindspeed_core.errors import DataError
from mindspeed_core.files import read_text

__all__ = [
    "HFTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "train_sentencepiece",
]

# Names used for special tokens when a tokenizer.json comes without a config.
_FALLBACK_PIECES = {
    "bos": ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"),
    "eos": ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"),
    "pad": ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>"),
    "unk": ("<unk>", "[UNK]", "<|unk|>"),
}
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class Tokenizer(ABC):
    """Text <-> token ids, whatever the backend.

    Attributes:
        path: the file the tokenizer was loaded from.
    """

    path: Path

    @abstractmethod
    def _encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; special tokens (bos, eos, pad, ...) are left out."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """The number of token ids (the embedding table needs at least this many rows)."""

    @abstractmethod
    def token_to_id(self, piece: str) -> int | None:
        """The id of a vocabulary piece, or None when it is not in the vocabulary."""

    @property
    @abstractmethod
    def special_tokens(self) -> dict[str, int]:
        """Every special (control) piece and its id, e.g. `{"<s>": 1, "</s>": 2}`."""

    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    _pad_id: int | None

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of `text`, optionally framed by BOS and EOS."""
        ids = self._encode(text)
        if add_bos:
            ids.insert(0, self._require("bos", self.bos_id))
        if add_eos:
            ids.append(self._require("eos", self.eos_id))
        return ids

    @property
    def eod_id(self) -> int | None:
        """The end-of-document token that separates packed documents (the EOS)."""
        return self.eos_id

    @property
    def pad_id(self) -> int | None:
        """The padding id: the pad token when defined, else the EOS."""
        return self._pad_id if self._pad_id is not None else self.eod_id

    def _require(self, name: str, value: int | None) -> int:
        if value is None:
            raise DataError(f"tokenizer {self.path} defines no {name} token")
        return value

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({str(self.path)!r}, vocab_size={self.vocab_size}, "
            f"bos={self.bos_id}, eos={self.eos_id}, pad={self.pad_id})"
        )


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece `.model` (Llama 2, Mistral, ...)."""

    def __init__(self, path: str | os.PathLike):
        import sentencepiece as spm

        self.path = Path(path)
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(str(self.path))
        except (OSError, RuntimeError) as err:
            raise DataError(f"cannot read sentencepiece model {self.path}: {err}") from None
        self.bos_id = _defined(self._sp.bos_id())
        self.eos_id = _defined(self._sp.eos_id())
        self.unk_id = _defined(self._sp.unk_id())
        self._pad_id = _defined(self._sp.pad_id())

    def _encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text, out_type=int))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; special tokens (bos, eos, pad, ...) are left out."""
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    def token_to_id(self, piece: str) -> int | None:
        index = self._sp.piece_to_id(piece)
        return index if self._sp.id_to_piece(index) == piece else None

    @cached_property
    def special_tokens(self) -> dict[str, int]:
        sp = self._sp
        return {
            sp.id_to_piece(i): i
            for i in range(sp.get_piece_size())
            if sp.is_control(i) or sp.is_unknown(i)
        }


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` (Llama 3, Qwen, ...), through `tokenizers`.

    The special tokens come from `tokenizer_config.json` or `special_tokens_map.json`
    next to the file when present, else from common names among its added tokens.
    `encode` never applies the file's post-processor: BOS/EOS are added on request only.
    """

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer as _Tokenizer

        self.path = Path(path)
        try:
            self._tok = _Tokenizer.from_file(str(self.path))
        except Exception as err:  # tokenizers raises a bare Exception on bad files
            raise DataError(f"cannot read tokenizer file {self.path}: {err}") from None
        names = _configured_special_tokens(self.path.parent)
        ids = {}
        for role, candidates in _FALLBACK_PIECES.items():
            piece = names.get(role)
            ids[role] = self._tok.token_to_id(piece) if piece else None
            if role not in names:  # no config: common names
                ids[role] = next(
                    (i for c in candidates if (i := self._tok.token_to_id(c)) is not None), None
                )
        self.bos_id, self.eos_id = ids["bos"], ids["eos"]
        self.unk_id, self._pad_id = ids["unk"], ids["pad"]

    def _encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; special tokens (bos, eos, pad, ...) are left out."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, piece: str) -> int | None:
        return self._tok.token_to_id(piece)

    @cached_property
    def special_tokens(self) -> dict[str, int]:
        added = self._tok.get_added_tokens_decoder()
        return {token.content: int(i) for i, token in sorted(added.items()) if token.special}


def _configured_special_tokens(folder: Path) -> dict[str, str | None]:
    """{"bos": "<s>", ...} from the Hugging Face config files in `folder` (may be empty)."""
    names: dict[str, str | None] = {}
    for filename in ("special_tokens_map.json", "tokenizer_config.json"):
        path = folder / filename
        if not path.is_file():
            continue
        try:
            config = json.loads(read_text(path))
        except ValueError as err:
            raise DataError(f"{path} is not valid JSON: {err}") from None
        for role in _FALLBACK_PIECES:
            if f"{role}_token" in config:
                value = config[f"{role}_token"]
                names[role] = value.get("content") if isinstance(value, dict) else value
    return names


def _defined(index: int) -> int | None:
    return index if index >= 0 else None


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer at `path`: a `.model` file, a `tokenizer.json`, or a folder with one.

    In a folder holding both, `tokenizer.json` wins (it carries the added tokens).

    Raises:
        DataError: the path does not exist (a hub name gets advice), holds no
            tokenizer, or the file cannot be read.
    """
    p = Path(path)
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            return HFTokenizer(p / "tokenizer.json")
        models = sorted(p.glob("*.model"))
        if (p / "tokenizer.model").is_file():
            return SentencePieceTokenizer(p / "tokenizer.model")
        if len(models) == 1:
            return SentencePieceTokenizer(models[0])
        raise DataError(
            f"no tokenizer in {p}: expected tokenizer.json or one sentencepiece .model file"
            + (f" (found {len(models)} .model files)" if models else "")
        )
    if p.is_file():
        if p.suffix == ".model":
            return SentencePieceTokenizer(p)
        if p.suffix == ".json":
            return HFTokenizer(p)
        raise DataError(
            f"unknown tokenizer file {p}: expected a sentencepiece .model or a tokenizer.json"
        )
    if _HUB_NAME.match(str(path)) and not str(path).startswith("."):
        raise DataError(
            f"tokenizer {path!s} is not a local path; MindSpeed does not download at run "
            f"time. Fetch it first (e.g. `huggingface-cli download {path} --local-dir DIR`) "
            "and pass the local folder"
        )
    raise DataError(f"tokenizer path does not exist: {p}")


def train_sentencepiece(
    texts: Iterable[str],
    model_prefix: str | os.PathLike,
    vocab_size: int,
    *,
    model_type: str = "bpe",
) -> Path:
    """Train a sentencepiece model in-process; returns `<model_prefix>.model`.

    Llama-like settings: byte fallback (any text round-trips), identity normalisation,
    digits split, ids unk 0, bos 1, eos 2, pad 3. Single-threaded over the texts in
    their order, so the same texts give the same file. It appears atomically.

    Raises:
        DataError: sentencepiece refuses the input (e.g. a vocabulary too large for it).
    """
    import sentencepiece as spm

    target = Path(f"{model_prefix}.model")
    target.parent.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()  # in memory: the file does not record a temporary path
    try:
        with open(os.devnull, "w") as quiet:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(texts),
                model_writer=model,
                logstream=quiet,
                minloglevel=2,  # the C++ trainer logs every step otherwise
                vocab_size=vocab_size,
                model_type=model_type,
                byte_fallback=True,
                character_coverage=1.0,
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                split_digits=True,
                num_threads=1,
                input_sentence_size=0,
                shuffle_input_sentence=False,
                max_sentence_length=1 << 16,
                unk_id=0,
                bos_id=1,
                eos_id=2,
                pad_id=3,
            )
    except RuntimeError as err:
        raise DataError(f"sentencepiece training for {target} failed: {err}") from None
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(model.getvalue())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target
