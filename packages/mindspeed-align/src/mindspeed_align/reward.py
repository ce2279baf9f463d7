"""Reward models: the decoder with a one-output head, trained on preference pairs.

`mindspeed rm` is the shared trainer (`mindspeed_llm.train.Trainer`) with DPO's pair data
(`pairs.PairData`: both sides of a pair are two documents of one packed row), the vocabulary
head swapped for `nn.Linear(hidden, 1)` before anything is split (`add_score_head`, the
engine's `before_tp` hook; under tensor parallel the head stays whole), and `RewardObjective`:
a sequence's score is the head's output at its last token that is not the pad id (Hugging
Face's `*ForSequenceClassification` pooling), the loss is `losses.reward_loss` (Bradley-Terry).
metrics.jsonl gets TRL's RewardTrainer names: `accuracy`, `margin`, `mean_reward`.
`export_classifier` writes a Hugging Face `*ForSequenceClassification` folder that transformers
loads and that gives the same scores.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from torch import Tensor, nn

from mindspeed_align.logps import SLOT_KEY, slot_count_tensor
from mindspeed_align.losses import reward_loss
from mindspeed_core.checkpoint.safetensors import SafetensorsWriter
from mindspeed_core.files import staged_folder
from mindspeed_llm.train.objectives import LossContext, LossOutput, Objective
from mindspeed_ops.validate import host_values

__all__ = [
    "RewardObjective",
    "add_score_head",
    "export_classifier",
    "full_state_dict",
    "load_classifier",
    "sequence_scores",
]

METRICS = ("accuracy", "margin", "mean_reward")
"""TRL RewardTrainer's metric names (means over the step's pairs)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "chat_template.jinja")  # fmt: skip


def add_score_head(model: nn.Module, dims=None, *, num_outputs: int = 1) -> None:
    """`before_tp` hook: the vocabulary head becomes a bias-free `Linear(hidden, num_outputs)`
    (the `score` of transformers' sequence and token classifiers), drawn from the run's seeded
    generator (`functools.partial` picks `num_outputs`)."""
    device = model.norm.weight.device
    model.output = nn.Linear(model.config.hidden_size, num_outputs, bias=False, device=device)


def sequence_scores(scores: Tensor, slots: Tensor, num_slots: int) -> Tensor:
    """The score of each slot's last token.

    Args:
        scores: (batch, seq, 1) head outputs.
        slots: (batch, seq) slot of each token (see `logps`), -1 for padding and pad ids.
        num_slots: 2 x the pairs of the batch.

    Returns:
        (num_slots,) fp32 scores (differentiable).
    """
    flat = slots.flatten()
    positions = torch.arange(flat.numel(), device=flat.device)
    kept = flat >= 0
    last = torch.full((num_slots,), -1, dtype=torch.long, device=flat.device)
    last = last.scatter_reduce(0, flat[kept], positions[kept], reduce="amax")
    if bool((last < 0).any()):
        raise ValueError("a sequence of the batch has no token besides padding")
    return scores.flatten()[last].float()


class RewardObjective(Objective):
    """Pairs are the units; a micro-batch's loss is the sum of its pairs' Bradley-Terry losses.

    Args:
        pad_id: the tokenizer's pad id; trailing pad ids do not count as a sequence's last token.
        center_coefficient: TRL's `center_rewards_coefficient` (None or 0: off).
    """

    metric_names = METRICS

    def __init__(self, pad_id: int, center_coefficient: float | None = None):
        self.pad_id, self.center_coefficient = pad_id, center_coefficient

    def setup(self, run) -> None:
        """The run's data knows the tokenizer's pad id."""
        pad_id = getattr(run.data, "pad_id", None)
        if pad_id is not None:
            self.pad_id = pad_id

    def num_units(self, batch):
        return (batch[SLOT_KEY].max() + 1) // 2

    def targets(self, batch):
        return {SLOT_KEY: batch[SLOT_KEY].masked_fill(batch["input_ids"] == self.pad_id, -1),
                "num_slots": slot_count_tensor(int(batch[SLOT_KEY].max()) + 1)}  # fmt: skip

    def loss(self, outputs, targets, ctx: LossContext) -> LossOutput:
        scores = sequence_scores(outputs, targets[SLOT_KEY], host_values(targets["num_slots"]))
        chosen, rejected = scores[0::2], scores[1::2]
        losses = reward_loss(chosen, rejected, center_coefficient=self.center_coefficient)
        margins = (chosen - rejected).detach()
        values = ((margins > 0).float(), margins, (chosen + rejected).detach() / 2)
        return LossOutput(losses.sum(), {k: v.sum() for k, v in zip(METRICS, values, strict=True)})


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter whole, on the CPU (call on every rank: sharded ones are gathered)."""
    from torch.distributed.tensor import DTensor

    state = {}
    for name, value in model.state_dict().items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        state[name] = value.detach().cpu()
    return state


def export_classifier(state: dict[str, Tensor], config, out: Path, *, pad_token_id: int,
                      tokenizer: Path | None = None, task: str = "sequence") -> Path:  # fmt: skip
    """Write a Hugging Face `*ForSequenceClassification` folder (task "sequence": a reward model)
    or `*ForTokenClassification` (task "token": a process reward model, its head without bias)
    (config.json with one label per head output, model.safetensors, the tokenizer's files) from
    the model's whole state dict.

    The folder appears whole or not at all (written beside it, then renamed).
    """
    from mindspeed_llm.models import get_model_spec

    state = dict(state)
    head = state.pop("output.weight")
    names_cfg = dataclasses.replace(config, tie_word_embeddings=True)  # no lm_head to map
    tensors = get_model_spec(config.family).hf_adapter.to_hf(state, names_cfg)
    tensors["score.weight"] = head
    hf_config = config.to_hf_dict()
    suffix = {"sequence": "ForSequenceClassification", "token": "ForTokenClassification"}[task]
    hf_config["architectures"] = [hf_config["architectures"][0].replace("ForCausalLM", suffix)]
    if task == "token":
        hf_config["token_classification_bias"] = False
    labels = [f"LABEL_{i}" for i in range(head.shape[0])]
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values()}
    hf_config.update(num_labels=len(labels), id2label={str(i): k for i, k in enumerate(labels)},
                     label2id={k: i for i, k in enumerate(labels)}, pad_token_id=pad_token_id,
                     torch_dtype=dtypes.pop() if len(dtypes) == 1 else "float32")  # fmt: skip
    out = Path(out)
    with staged_folder(out) as tmp:
        writer = SafetensorsWriter(
            tmp / "model.safetensors", [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
        )
        for name, tensor in tensors.items():
            writer.write(name, tensor)
        writer.close()
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        _copy_tokenizer(tokenizer, tmp)
    return out


def load_classifier(path: Path, device: torch.device | str = "cpu"):
    """The model of a Hugging Face `*ForSequenceClassification` folder (what
    `export_classifier` writes, e.g. `mindspeed rm --rm.export_hf`): our decoder with its
    `score` head as `output`, frozen, in eval mode; (model, config, pad id).

    Raises:
        ConfigError: not such a folder (its architectures named), or its tensors do not fit.
    """
    from mindspeed_core.errors import ConfigError
    from mindspeed_llm.models import get_model_spec
    from mindspeed_llm.models.hf_io import iter_hf_tensors, read_hf_config

    path = Path(path)
    config_file = path / "config.json"
    hf_config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    architectures = hf_config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ConfigError(f"{path}: not a Hugging Face *ForSequenceClassification folder "
                          f"(architectures: {architectures or 'none'})")  # fmt: skip
    config = read_hf_config(path)
    tensors = dict(iter_hf_tensors(path))
    head = tensors.pop("score.weight", None)
    if head is None or head.shape[0] != 1:
        raise ConfigError(f"{path}: a reward model needs a one-output score.weight")
    names_cfg = dataclasses.replace(config, tie_word_embeddings=True)  # no lm_head to map
    state = get_model_spec(config.family).hf_adapter.from_hf(tensors, names_cfg)
    state["output.weight"] = head
    with torch.device(device):
        model = get_model_spec(config.family).build(config)
        add_score_head(model)
    try:
        model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
    except RuntimeError as err:
        raise ConfigError(f"{path}: {str(err).strip().splitlines()[0]}") from None
    pad_id = hf_config.get("pad_token_id")
    return model.requires_grad_(False).eval(), config, 0 if pad_id is None else int(pad_id)


def _copy_tokenizer(tokenizer: Path | None, dest: Path) -> None:
    if tokenizer is None:
        return
    tokenizer = Path(tokenizer)
    if tokenizer.is_dir():
        for name in TOKENIZER_FILES:
            if (tokenizer / name).is_file():
                shutil.copy2(tokenizer / name, dest / name)
    elif tokenizer.suffix in (".json", ".model"):
        shutil.copy2(tokenizer, dest / f"tokenizer{tokenizer.suffix}")
