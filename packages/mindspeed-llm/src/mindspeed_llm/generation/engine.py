"""Token-level generation: prefill the prompts, then decode one token per step.

Prompts of different lengths are padded on the left; the KV cache hides the padding and
position ids start at 0 on the first real token, so a padded row decodes exactly what it
would decode alone. Without the cache (`use_cache=False`) every step runs the whole
sequences again, packed into one row with `cu_seqlens` (no padding at all): the slow
reference the cache is tested against.

Under tensor parallel every rank runs the same loop on the same (replicated) logits and
draws from a generator seeded alike, so all ranks produce the same tokens.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from mindspeed_core.errors import DataError
from mindspeed_core.parallel import apply_compile, dtensor
from mindspeed_core.parallel.compile import is_compiled
from mindspeed_llm.generation.beam import Beam, beam_search
from mindspeed_llm.generation.config import GenerationConfig
from mindspeed_llm.generation.kv_cache import KVCache
from mindspeed_llm.generation.sampling import next_tokens

StreamCallback = Callable[[int, int], bool | None]


def generate(
    model: nn.Module,
    prompts_token_ids: Sequence[Sequence[int]],
    config: GenerationConfig | None = None,
    *,
    stream: StreamCallback | None = None,
) -> list[list[int]]:
    """New tokens for each prompt.

    Args:
        model: a `Transformer` (whole, or tensor parallel with replicated logits).
        prompts_token_ids: one non-empty list of token ids per prompt.
        config: decoding settings (default: greedy, 256 new tokens). `stop_strings`
            need text: use `Generator`.
        stream: called as `stream(row, token)` for every new token as it is drawn; a
            true return ends that row there.

    Returns:
        For each prompt its new tokens, a stop token included as the last one; with
        `config.num_return_sequences` n > 1, n lists per prompt, prompt after prompt.
    """
    steps = TokenSteps(model, prompts_token_ids, config or GenerationConfig())
    for new in steps:
        if stream is not None:
            for row, token in new:
                if stream(row, token):
                    steps.finish(row)
    return steps.outputs


class TokenSteps:
    """Generation as an iterator: each step yields `[(row, token), ...]` for the rows still
    running; `finish(row)` between steps ends a row. `outputs` holds the new tokens.

    Finished rows leave the batch (their KV cache rows dropped) once a quarter of the rows
    still in it have finished, so a rollout whose samples end early stops paying for them;
    `active` lists the rows of the batch the last logits were computed for.

    With `config.num_beams > 1` the whole beam search runs first (`generation.beam`); the
    steps then replay each prompt's best `num_return_sequences` beams token by token, and
    `beams` holds every prompt's finished beams with their scores."""

    def __init__(
        self,
        model: nn.Module,
        prompts: Sequence[Sequence[int]],
        config: GenerationConfig,
        *,
        on_logits: Callable[[Tensor], None] | None = None,
    ):
        self.model, self.config = model, config
        self.on_logits = on_logits
        """Called with each step's next-token logits (rows: `active`, in that order) before a
        token is drawn from them: how a rollout keeps the sampler's own log-probs."""
        if config.compile:
            compile_for_decoding(model)
        n = config.num_return_sequences
        unique = _checked_prompts(prompts, model.config.vocab_size)
        self.prompts = [p for p in unique for _ in range(n)]  # row = prompt * n + sample
        self.outputs: list[list[int]] = [[] for _ in self.prompts]
        self.finished = [False] * len(self.prompts)
        longest = max(len(p) for p in self.prompts)
        context = model.config.max_position_embeddings
        if longest >= context:
            raise DataError(
                f"a prompt of {longest} tokens leaves no room in the model's context of "
                f"{context} positions"
            )
        self.max_new_tokens = min(config.max_new_tokens, context - longest)
        self.device = dtensor.local(model.tok_embeddings.weight).device
        self._stop_ids = frozenset(config.stop_token_ids)
        self._cache: KVCache | None = None
        self._positions: Tensor | None = None
        self._started = False
        self.active = list(range(len(self.prompts)))
        self.beams: list[list[Beam]] | None = None

    def finish(self, row: int) -> None:
        self.finished[row] = True

    @torch.inference_mode()
    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        if self._started:
            raise RuntimeError("a TokenSteps runs once; make a new one to generate again")
        self._started = True
        config = self.config
        if config.num_beams > 1:
            yield from self._replay_beams()
            return
        seen = self._seen() if config.repetition_penalty != 1.0 else None
        generator = None
        if not config.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(_shared_seed(self.model, config.seed))
        logits = self._prefill() if config.use_cache else self._recompute()
        for step in range(self.max_new_tokens):
            if self.on_logits is not None:
                self.on_logits(logits)
            tokens = next_tokens(logits, config, seen, generator)
            new = []
            for row, token in zip(self.active, tokens.tolist(), strict=True):
                if not self.finished[row]:
                    self.outputs[row].append(token)
                    new.append((row, token))
                    self.finished[row] = token in self._stop_ids
            yield new
            if step + 1 == self.max_new_tokens or all(self.finished):
                return
            if seen is not None:
                seen.scatter_(1, tokens[:, None], True)
            tokens, seen = self._drop_finished(tokens, seen)
            logits = self._decode(tokens) if config.use_cache else self._recompute()

    def _replay_beams(self) -> Iterator[list[tuple[int, int]]]:
        n = self.config.num_return_sequences
        self.beams = beam_search(self.model, self.prompts[::n], self.config, self.max_new_tokens)
        for row in range(len(self.prompts)):
            self.outputs[row] = []
        chosen = [beam.tokens for beams in self.beams for beam in beams[:n]]
        for step in range(max(len(tokens) for tokens in chosen)):
            new = []
            for row, tokens in enumerate(chosen):
                if step < len(tokens) and not self.finished[row]:
                    self.outputs[row].append(tokens[step])
                    new.append((row, tokens[step]))
                    self.finished[row] = step + 1 == len(tokens)
            yield new

    def _drop_finished(self, tokens: Tensor, seen: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Take finished rows out of the batch once a quarter of it has finished (each
        drop copies the cache, so not at every single finish)."""
        keep = [i for i, row in enumerate(self.active) if not self.finished[row]]
        if len(self.active) - len(keep) < max(1, len(self.active) // 4):
            return tokens, seen
        index = torch.tensor(keep, device=self.device)
        self.active = [self.active[i] for i in keep]
        if self._cache is not None:
            self._cache.keep_rows(index)
            self._positions = self._positions.index_select(0, index)
        return tokens.index_select(0, index), None if seen is None else seen.index_select(0, index)

    def _seen(self) -> Tensor:
        """(batch, vocab) bool: the tokens of each prompt."""
        seen = torch.zeros(
            len(self.prompts), self.model.config.vocab_size, dtype=torch.bool, device=self.device
        )
        for row, prompt in enumerate(self.prompts):
            seen[row, torch.tensor(prompt, device=self.device)] = True
        return seen

    def _prefill(self) -> Tensor:
        """Prefill each prompt once; its n sample rows share its keys and values."""
        n = self.config.num_return_sequences
        prompts = self.prompts[::n]
        lengths = [len(p) for p in prompts]
        longest = max(lengths)
        pads = [longest - length for length in lengths]
        tokens = torch.tensor(
            [[0] * pad + p for pad, p in zip(pads, prompts, strict=True)], device=self.device
        )
        pad_t = torch.tensor(pads, device=self.device)[:, None]
        positions = (torch.arange(longest, device=self.device)[None, :] - pad_t).clamp_(min=0)
        self._cache = KVCache.for_model(self.model, len(prompts), longest + self.max_new_tokens)
        self._cache.reset(pads)
        logits = self.model(tokens, position_ids=positions, kv_cache=self._cache, logits_to_keep=1)
        self._cache.repeat_rows(n)
        self._positions = torch.tensor(lengths, device=self.device).repeat_interleave(n)[:, None]
        return self._last_logits(logits).repeat_interleave(n, dim=0)

    def _decode(self, tokens: Tensor) -> Tensor:
        logits = self.model(tokens[:, None], position_ids=self._positions, kv_cache=self._cache)
        self._positions += 1
        return self._last_logits(logits)

    def _recompute(self) -> Tensor:
        """Next-token logits of every row from a full forward of its whole sequence."""
        rows = [self.prompts[r] + self.outputs[r] for r in self.active]
        lengths = torch.tensor([len(r) for r in rows], device=self.device)
        ends = lengths.cumsum(0)
        cu_seqlens = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
        tokens = torch.tensor([t for r in rows for t in r], device=self.device)[None, :]
        logits = dtensor.full(self.model(tokens, cu_seqlens=cu_seqlens))
        return logits[0, ends - 1]

    @staticmethod
    def _last_logits(logits: Tensor) -> Tensor:
        return dtensor.full(logits)[:, -1]


def compile_for_decoding(model: nn.Module) -> nn.Module:
    """torch.compile each block of `model` (a `Transformer`) for generation, once."""
    if not all(is_compiled(block) for block in model.layers.values()):
        apply_compile(model, fullgraph=False, dynamic=True)
    return model


def _checked_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    if isinstance(prompts, Tensor):
        prompts = prompts.tolist()
    if not prompts:
        raise DataError("no prompts to generate from")
    checked = []
    for row, prompt in enumerate(prompts):
        ids = [int(t) for t in prompt]
        if not ids:
            raise DataError(f"prompt {row} is empty")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise DataError(
                f"prompt {row} holds token id {bad}, outside the vocabulary 0..{vocab_size - 1}"
            )
        checked.append(ids)
    return checked


def _shared_seed(model: nn.Module, seed: int | None) -> int:
    """`seed`, or a fresh one that every rank of the model's mesh agrees on."""
    if seed is not None:
        return seed
    seed = secrets.randbits(62)
    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    if mesh is not None:
        value = torch.tensor([seed], device=mesh.device_type)
        for dim in range(mesh.ndim):
            dist.broadcast(value, group=mesh.get_group(dim), group_src=0)
        seed = int(value.item())
    return seed
