"""Score text with a model the way lm-eval's Hugging Face backend does, without lm-eval.

`Scorer` holds a loaded model and its tokenizer and answers the three questions every
benchmark asks: the log-likelihood of a continuation after a context (and whether greedy
decoding would produce it), the log-likelihood of a whole document in rolling windows,
and greedy (or sampled) text up to stop strings. The rules are lm-eval 0.4's
(`TemplateLM`, `HFLM`): trailing spaces of a context move into the continuation; an empty
context is the BOS (or EOS) token; inputs longer than `max_length` are cut from the left;
rolling windows predict every token once; generation contexts keep
`max_length - max_gen_toks` tokens and the text ends before the first stop string. So
`mindspeed_eval.lm.MindSpeedLM` is a thin lm-eval adapter over this class and our own
runners (`mindspeed eval`) use it directly.

Faster than HFLM on the same weights because it never materialises (batch, seq, vocab)
logits: the decoder runs on the right-padded batch, and the output projection only on
the positions a continuation is scored at. Requests whose inputs are identical (the
choices of a multiple-choice question, when each choice is one token) share one row.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from mindspeed_core.errors import ConfigError
from mindspeed_eval.loading import EvalMesh, LoadedModel
from mindspeed_llm.chat_template import encode_text, load_chat_template
from mindspeed_llm.tokenizer import SentencePieceTokenizer, Tokenizer

TokenPair = tuple[list[int], list[int]]
"""(context token ids, continuation token ids)."""


@dataclass(kw_only=True)
class ScorerConfig:
    """How requests are batched and cut."""

    batch_size: int = 8
    """Rows per forward pass (sequences for log-likelihoods, prompts for generation)."""
    max_length: int | None = None
    """Longest input in tokens (default: the model's max_position_embeddings)."""
    max_gen_toks: int = 256
    """New tokens per generation unless a request says otherwise."""
    add_bos_token: bool | None = None
    """Prefix BOS when encoding; None: what the tokenizer does by default (as transformers)."""
    chat_template: str | None = None
    """A chat template file or folder (default: the tokenizer's folder, else ChatML)."""

    def __post_init__(self):
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, got {self.batch_size}")
        if self.max_gen_toks < 1:
            raise ConfigError(f"max_gen_toks must be at least 1, got {self.max_gen_toks}")


class Scorer:
    """Log-likelihoods and generations of one model (see the module docstring)."""

    def __init__(self, loaded: LoadedModel, config: ScorerConfig | None = None):
        self.loaded = loaded
        self.config = config or ScorerConfig()
        self.model: nn.Module = loaded.model
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.mesh: EvalMesh = loaded.mesh
        self.device = loaded.device
        self.max_length = self.config.max_length or loaded.config.max_position_embeddings
        add_bos = self.config.add_bos_token
        self.add_bos_token = default_add_bos(self.tokenizer) if add_bos is None else add_bos
        self._template = None

    # -- tokens -----------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_id
        assert eos is not None, f"tokenizer {self.tokenizer.path} has no EOS token"
        return eos

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is: BOS, else EOS (HFLM's choice)."""
        bos = self.tokenizer.bos_id
        return bos if bos is not None else self.eot_token_id

    def tok_encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of `text`, special-token pieces in it included; BOS first when
        `add_special_tokens` (None: the tokenizer's default, and not if `text` already
        begins with the BOS piece)."""
        ids = encode_text(self.tokenizer, text) if text else []
        bos = self.tokenizer.bos_id
        add = self.add_bos_token if add_special_tokens is None else add_special_tokens
        if add and bos is not None and not (add_special_tokens is None and ids[:1] == [bos]):
            ids.insert(0, bos)
        return ids

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def encode_pair(self, context: str, continuation: str) -> TokenPair:
        """lm-eval's split: encode context + continuation whole, the context alone, and
        give the continuation what is left (so merges across the boundary count)."""
        if context == "":
            cont = self.tok_encode(continuation, add_special_tokens=False)
            if cont[:1] == [self.prefix_token_id]:
                return cont[:1], cont[1:]
            return [self.prefix_token_id], cont
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        return ctx, whole[len(ctx) :]

    @property
    def chat_template(self):
        """The model's `ChatTemplate` (`config.chat_template`, else the tokenizer's folder's,
        else ChatML), loaded on first use."""
        if self._template is None:
            source = self.config.chat_template or self.tokenizer.path.parent
            self._template = load_chat_template(source)
        return self._template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages` through the model's chat template."""
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)

    # -- log-likelihoods --------------------------------------------------------------

    def loglikelihood(
        self, pairs: Sequence[tuple[str, str]], *, progress: bool = False
    ) -> list[tuple[float, bool]]:
        """(log p(continuation | context), is the continuation the greedy one) per pair."""
        return self.loglikelihood_tokens([self.encode_pair(c, x) for c, x in pairs], progress)

    def loglikelihood_tokens(
        self, requests: Sequence[TokenPair], progress: bool = False
    ) -> list[tuple[float, bool]]:
        """As `loglikelihood`, on token ids; inputs over `max_length + 1` lose their left."""
        keys = []
        keep: dict[tuple[int, ...], int] = {}  # identical inputs share one row
        for ctx, cont in requests:
            assert cont, "an empty continuation scores nothing"
            key = tuple((ctx + cont)[-(self.max_length + 1) :][:-1])
            keep[key] = max(keep.get(key, 0), len(cont))
            keys.append(key)
        users = Counter(keys)
        rows = sorted(keep, key=lambda k: (-len(k), k))  # longest first, as HFLM
        scores: dict[tuple[int, ...], Tensor] = {}
        bar = tqdm(total=len(requests), desc="log-likelihoods", disable=not progress, leave=False)
        for start in range(0, len(rows), self.config.batch_size):
            batch = rows[start : start + self.config.batch_size]
            scores.update(zip(batch, self._last_logprobs(batch, keep), strict=True))
            bar.update(sum(users[k] for k in batch))
        bar.close()
        out = []
        for key, (_, cont) in zip(keys, requests, strict=True):
            logprobs = scores[key][-len(cont) :]
            target = torch.tensor(cont, device=logprobs.device)
            picked = logprobs.gather(1, target[:, None])[:, 0]
            out.append((float(picked.sum()), bool((logprobs.argmax(-1) == target).all())))
        return out

    @torch.inference_mode()
    def _last_logprobs(
        self, batch: list[tuple[int, ...]], keep: dict[tuple[int, ...], int]
    ) -> list[Tensor]:
        """fp32 log-softmax over the vocabulary at the last `keep[row]` positions of each row."""
        longest = len(batch[0])
        pad = self.tokenizer.pad_id or 0
        tokens = torch.tensor(
            [list(r) + [pad] * (longest - len(r)) for r in batch], device=self.device
        )
        hidden = decoder_hidden_states(self.model, tokens)  # (batch, seq, hidden)
        picks = [hidden[i, len(r) - keep[r] : len(r)] for i, r in enumerate(batch)]
        logits = _full(self.model.project(torch.cat(picks)))  # (sum of keeps, vocab)
        logprobs = F.log_softmax(logits.float(), dim=-1)
        return list(logprobs.split([keep[r] for r in batch]))

    def loglikelihood_rolling(self, texts: Sequence[str], *, progress: bool = False) -> list[float]:
        """Log-likelihood of each whole text given the prefix token, in disjoint windows of
        `max_length` (lm-eval's `get_rolling_token_windows` with context_len 1)."""
        windows, owners = [], []
        for i, text in enumerate(texts):
            for pair in rolling_windows(
                self.tok_encode(text), self.prefix_token_id, self.max_length
            ):
                windows.append(pair)
                owners.append(i)
        totals = [0.0] * len(texts)
        for owner, (logprob, _) in zip(
            owners, self.loglikelihood_tokens(windows, progress), strict=True
        ):
            totals[owner] += logprob
        return totals

    # -- generation -------------------------------------------------------------------

    def generate_until(
        self,
        contexts: Sequence[str],
        *,
        until: Sequence[str] = (),
        max_gen_toks: int | None = None,
        temperature: float = 0.0,
        seed: int | None = None,
        progress: bool = False,
    ) -> list[str]:
        """The text each context continues with, ended before the first of `until`."""
        from mindspeed_llm.generation import GenerationConfig, Generator

        max_new = max_gen_toks or self.config.max_gen_toks
        if max_new >= self.max_length:
            raise ConfigError(
                f"max_gen_toks={max_new} leaves no room in max_length={self.max_length}"
            )
        config = GenerationConfig(
            max_new_tokens=max_new,
            temperature=temperature,
            stop_strings=tuple(s for s in until if s),
            stop_token_ids=(self.eot_token_id,),
            seed=seed,
        )
        generator = Generator(self.model, self.tokenizer, config)
        prompts = [self.tok_encode(c)[-(self.max_length - max_new) :] for c in contexts]
        order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), contexts[i]))
        out: list[str] = [""] * len(prompts)
        bar = tqdm(total=len(prompts), desc="generating", disable=not progress, leave=False)
        for start in range(0, len(order), self.config.batch_size):
            rows = order[start : start + self.config.batch_size]
            for row, text in zip(rows, generator.generate([prompts[r] for r in rows]), strict=True):
                out[row] = text
            bar.update(len(rows))
        bar.close()
        return out


def decoder_hidden_states(model: nn.Module, tokens: Tensor) -> Tensor:
    """Final-norm hidden states of a `Transformer` for (batch, seq) tokens, positions
    0..seq-1 in every row (right padding cannot reach earlier positions); the model's
    `project` makes logits of the positions scoring needs."""
    return model(tokens, return_hidden=True)


def _full(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def rolling_windows(tokens: list[int], prefix: int, max_length: int) -> list[TokenPair]:
    """Disjoint (context, continuation) windows that predict every token once, each input
    as long as fits: lm-eval's `get_rolling_token_windows` (context_len 1) followed by
    `make_disjoint_window`."""
    if not tokens:
        return []
    first = min(max_length, len(tokens))
    windows = [([prefix], tokens[:first])]
    predicted = first
    while predicted < len(tokens):
        num = min(len(tokens) - predicted, max_length)
        end = predicted + num
        context = tokens[end - max_length - 1 : end - 1]
        windows.append((context[: len(context) - (num - 1)], tokens[end - num : end]))
        predicted = end
    return windows


def default_add_bos(tokenizer: Tokenizer) -> bool:
    """Whether transformers' tokenizer for these files adds BOS by default: a
    `tokenizer_config.json` `add_bos_token` wins; a `tokenizer.json` adds it when its
    post-processor starts with the BOS piece; a sentencepiece model does (Llama's default)."""
    folder = tokenizer.path.parent
    config = _read_json(folder / "tokenizer_config.json")
    if isinstance(config.get("add_bos_token"), bool):
        return config["add_bos_token"] and tokenizer.bos_id is not None
    if isinstance(tokenizer, SentencePieceTokenizer):
        return tokenizer.bos_id is not None
    spec = _read_json(tokenizer.path).get("post_processor") or {}
    return _adds_first(spec, tokenizer)


def _adds_first(spec: dict, tokenizer: Tokenizer) -> bool:
    if spec.get("type") == "Sequence":
        return any(_adds_first(p, tokenizer) for p in spec.get("processors", []))
    if spec.get("type") == "TemplateProcessing":
        first = (spec.get("single") or [{}])[0]
        piece = (first.get("SpecialToken") or {}).get("id")
        return piece is not None and tokenizer.token_to_id(piece) == tokenizer.bos_id
    return spec.get("type") in ("BertProcessing", "RobertaProcessing")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
