"""Our models as an lm-eval model: `MindSpeedLM`, registered as "mindspeed".

    import mindspeed_eval.lm, lm_eval
    lm_eval.simple_evaluate(model="mindspeed", model_args="model=runs/pretrain/checkpoints",
                            tasks=[...])

or from a shell, `mindspeed-lm-eval --model mindspeed --model_args model=DIR,batch_size=16
--tasks ...` (lm-eval's own command line, with this module imported first: lm-eval 0.4
looks models up only in its own registry, so the plain `lm_eval` script cannot find
models of other packages). Model arguments: `model` (HF folder, converted checkpoint or a
run's checkpoints), `tokenizer`, `device`, `dtype`, `batch_size`, `max_length`,
`max_gen_toks`, `add_bos_token`, `tp`, `chat_template`.

The Hugging Face backend's spellings are accepted as its users type them: `pretrained=` for
`model=`, `dtype=float32|bfloat16|float16|auto` (and `torch.float32` ...) beside ours
(`fp32|bf16|fp16`), `batch_size=auto`; `trust_remote_code=True` is refused (a MindSpeed model
runs only this project's code, never a folder's Python).

Under torchrun, ranks form groups of `tp` (each holds one tensor-parallel copy of the
model) and lm-eval's evaluator gives each group its own share of the requests: `rank` and
`world_size` here are the data-parallel rank and degree, as lm-eval expects of TP
launchers (it prints on LOCAL_RANK 0).

Needs lm-eval (`pip install mindspeed-eval[lm-eval]`); nothing else in mindspeed_eval does.
The scoring itself is `mindspeed_eval.scorer.Scorer`, which imports no lm-eval and no
transformers.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

try:
    import lm_eval.models  # noqa: F401  (fills lm-eval's registry before we add to it)
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as err:  # pragma: no cover - exercised without the extra installed
    raise ImportError(
        "mindspeed_eval.lm needs lm-eval: pip install 'mindspeed-eval[lm-eval]'"
    ) from err

from mindspeed_eval.loading import load_for_eval
from mindspeed_eval.scorer import Scorer, ScorerConfig

DEFAULT_MAX_GEN_TOKS = 256
logger = logging.getLogger(__name__)


def _flag(value) -> bool | None:
    """lm-eval passes model_args as strings ("True", "false") or Python values."""
    if value is None or isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("1", "true", "yes")


@register_model("mindspeed")
class MindSpeedLM(TemplateLM):
    """A MindSpeed model behind lm-eval's `LM` interface (see the module docstring)."""

    def __init__(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int | str = 8,
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        add_bos_token: bool | str | None = None,
        tp: int = 1,
        chat_template: str | None = None,
        scorer: Scorer | None = None,
        pretrained: str | None = None,
        trust_remote_code: bool | str | None = None,
        **unused,
    ):
        super().__init__()
        if scorer is None:
            model = _model_path(model, pretrained)
            if _flag(trust_remote_code):
                raise ValueError(
                    "trust_remote_code=True: a MindSpeed model runs only MindSpeed's own code, "
                    "never Python from the model folder; drop the argument"
                )
            loaded = load_for_eval(
                model,
                tokenizer=tokenizer,
                device=_device_type(device),
                dtype=_dtype(dtype),
                tp=int(tp),
            )
            config = ScorerConfig(
                batch_size=_batch_size(batch_size),
                max_length=int(max_length) if max_length else None,
                max_gen_toks=int(max_gen_toks),
                add_bos_token=_flag(add_bos_token),
                chat_template=chat_template,
            )
            scorer = Scorer(loaded, config)
        self.scorer = scorer
        self._rank = scorer.mesh.dp_rank
        self._world_size = scorer.mesh.dp_size
        self._device = scorer.device

    # -- what TemplateLM asks ----------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.scorer.eot_token_id

    @property
    def prefix_token_id(self) -> int:
        return self.scorer.prefix_token_id

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    @property
    def max_gen_toks(self) -> int:
        return self.scorer.config.max_gen_toks

    @property
    def batch_size(self) -> int:
        return self.scorer.config.batch_size

    @property
    def tokenizer_name(self) -> str:
        return str(self.scorer.tokenizer.path).replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        ids = self.scorer.tok_encode(string, add_special_tokens)
        left = kwargs.get("left_truncate_len")
        return ids[-left:] if left else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.scorer.tok_decode(tokens)

    def _encode_pair(self, context: str, continuation: str):
        # Ours, not TemplateLM's: lm-eval before 0.4.10 imports transformers in it.
        return self.scorer.encode_pair(context, continuation)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        return self.scorer.loglikelihood_tokens(pairs, progress=self._progress(disable_tqdm))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = [req.args[0] for req in requests]
        return self.scorer.loglikelihood_rolling(texts, progress=self._progress(disable_tqdm))

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        out: list[str] = [""] * len(requests)
        for rows in groups.values():
            kwargs = dict(requests[rows[0]].args[1])
            contexts = [requests[i].args[0] for i in rows]
            texts = self.scorer.generate_until(
                contexts,
                progress=self._progress(disable_tqdm),
                **_generation_options(kwargs, self.max_gen_toks),
            )
            for i, text in zip(rows, texts, strict=True):
                out[i] = text
        return out

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        return self.scorer.apply_chat_template(
            list(chat_history), add_generation_prompt=add_generation_prompt
        )

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template is False or chat_template is None:
            return None
        return self.scorer.chat_template.source

    # -- data parallel over groups of tp ranks ---------------------------------------

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size <= 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.scorer.mesh.dp_group)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        if self.world_size <= 1:
            return [obj]
        parts = [None] * self.world_size
        dist.all_gather_object(parts, obj, group=self.scorer.mesh.dp_group)
        return parts if self.rank == dst else None

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.scorer.mesh.dp_group)

    def _progress(self, disable_tqdm: bool) -> bool:
        return not disable_tqdm and self.scorer.mesh.is_main


def _device_type(device: str | None) -> str:
    """lm-eval's `--device` ("cuda:0" by default) as a device type; one that is not
    present means auto (HFLM falls back the same way)."""
    from mindspeed_core import device as dev

    kind = str(device or "auto").split(":")[0]
    if kind != "auto" and not dev.is_available(kind):
        logger.warning("device %r is not available here; using what is (auto)", device)
        return "auto"
    return kind


def _model_path(model: str | None, pretrained: str | None) -> str:
    """`model=`, or HFLM's spelling `pretrained=`; both only when they agree."""
    if model is not None and pretrained is not None and str(model) != str(pretrained):
        raise ValueError(f"model={model} and pretrained={pretrained} name two models: give one")
    path = model if model is not None else pretrained
    if path is None:
        raise ValueError("MindSpeedLM needs model=DIR (or pretrained=DIR, or a scorer)")
    return str(path)


_DTYPE_SPELLINGS = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16",
                    "half": "fp16"}  # fmt: skip


def _dtype(value) -> str:
    """Our dtype name for HFLM's spellings (float32, bfloat16, float16, torch.float16, auto)."""
    name = str(value if value is not None else "auto").strip().lower().removeprefix("torch.")
    return _DTYPE_SPELLINGS.get(name, name)


def _batch_size(value: int | str) -> int:
    if str(value).startswith("auto"):
        return 8  # no probing for the largest batch: the scorer's memory is already small
    return int(value)


def _generation_options(kwargs: dict, default_max: int) -> dict:
    """lm-eval's gen_kwargs as `Scorer.generate_until` options (HFLM's reading)."""
    until = kwargs.pop("until", None)
    until = [until] if isinstance(until, str) else list(until or [])
    max_gen = kwargs.pop("max_gen_toks", None) or kwargs.pop("max_new_tokens", None)
    do_sample = bool(kwargs.pop("do_sample", False))
    temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
    return {
        "until": until,
        "max_gen_toks": int(max_gen or default_max),
        "temperature": (temperature or 1.0) if do_sample else 0.0,
        "seed": kwargs.pop("seed", None),
    }
