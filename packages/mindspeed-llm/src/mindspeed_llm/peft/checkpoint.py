"""A LoRA run's checkpoints: adapters only, over the base its config.yaml names.

A trainer run with `lora.rank > 0` saves only the adapter tensors (and buffers); its
`config.yaml` holds the `lora` section and where the frozen base came from
(`model.hf_path`, or `checkpoint.load` of a converted checkpoint). `run_lora`
tells such a run from a full one; `load_adapter_weights` rebuilds base + adapters in a
plain model (what `mindspeed_llm.loading.load_model` does for generate, chat and eval, merged);
`write_peft_adapter` writes the folder `peft.PeftModel.from_pretrained` loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from mindspeed_core.checkpoint.steps import resolve
from mindspeed_core.errors import CheckpointError, ConfigError
from mindspeed_llm.models import checkpoint_io as ckpt
from mindspeed_llm.models.config import TransformerConfig
from mindspeed_llm.models.hf_io import load_hf_weights
from mindspeed_llm.peft.lora import LoRAConfig, apply_lora
from mindspeed_llm.peft.names import EXPERT_ADAPTERS, PEFT_PREFIX, hf_module_names, to_peft_names
from mindspeed_llm.peft.peft_experts import peft_expert_adapters

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "load_adapter_weights",
    "read_adapters",
    "run_base",
    "run_lora",
    "write_peft_adapter",
]


def run_lora(folder: Path) -> LoRAConfig | None:
    """The `lora` section of the run whose checkpoints are in `folder`, when it trained
    adapters (rank > 0); None for a full run or a converted checkpoint.

    Raises:
        ConfigError: a `lora` section that `LoRAConfig` refuses.
    """
    run = ckpt.run_config(folder)
    if run is None:
        return None
    section = run.get("lora") or {}
    if not section.get("rank"):
        return None
    try:
        return LoRAConfig(**section)
    except TypeError as err:
        raise ConfigError(f"{ckpt.run_config_path(folder)}: lora section: {err}") from None


WARM_START_SECTIONS = ("grpo", "ppo")
"""Config sections whose `init_from` is the policy's warm start (RL's: `mindspeed grpo`,
`dapo` and `ppo`), the base of a LoRA run when set."""


def run_base(folder: Path) -> tuple[str, Path]:
    """Where a LoRA run's frozen base came from: an RL run's `init_from` (a Hugging Face
    folder or a MindSpeed checkpoint), ("hf", `model.hf_path`) or ("checkpoint", the step
    folder of `checkpoint.load`, e.g. a converted checkpoint).

    Raises:
        CheckpointError: the run names neither (its checkpoints hold adapters only).
    """
    data = ckpt.run_config(folder) or {}
    for section in WARM_START_SECTIONS:  # loaded over model.hf_path: the base, when set
        init_from = (data.get(section) or {}).get("init_from")
        if init_from:
            path = Path(init_from)
            return ("checkpoint", resolve(path)) if ckpt.is_mindspeed_checkpoint(path) else ("hf", path)  # fmt: skip
    hf_path = (data.get("model") or {}).get("hf_path")
    if hf_path:
        return "hf", Path(hf_path)
    load = (data.get("checkpoint") or {}).get("load")
    if load and str(load) not in ("auto", "none"):
        return "checkpoint", resolve(Path(load))
    raise CheckpointError(
        f"{folder}: a LoRA run's checkpoints hold only adapters, and its config.yaml names "
        "neither model.hf_path nor checkpoint.load to load the base from"
    )


def load_adapter_weights(
    model: nn.Module, folder: Path, step_dir: Path, config: TransformerConfig, lora: LoRAConfig
) -> nn.Module:
    """Load the run's base into plain `model`, add `lora`'s adapters and load them from
    the DCP step `step_dir`; returns `model` (adapters unmerged, see `merge_lora`).

    Raises:
        CheckpointError: no base, or the checkpoint lacks an adapter tensor.
    """
    kind, base = run_base(folder)
    if kind == "hf":
        load_hf_weights(model, base, config)
    else:
        ckpt.load_model_weights(model, base)
    apply_lora(model, lora)
    model.requires_grad_(True)
    tensors = read_adapters(step_dir)
    wanted = {n for n, _ in model.named_parameters() if ".lora_" in n}
    if wanted - set(tensors):
        raise CheckpointError(
            f"{step_dir} lacks adapter {sorted(wanted - set(tensors))[0]} of lora.targets="
            f"{lora.targets}"
        )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in wanted:
            params[name].copy_(tensors[name])
    return model


def read_adapters(step_dir: Path) -> dict[str, torch.Tensor]:
    """Our name -> tensor of every adapter in a DCP step folder."""
    stored = ckpt.tensor_metadata(step_dir)
    return ckpt.read_tensors(step_dir, {k: v for k, v in stored.items() if ".lora_" in k})


def write_peft_adapter(
    folder: Path, step_dir: Path, config: TransformerConfig, lora: LoRAConfig, out: Path
) -> None:
    """adapter_config.json + adapter_model.safetensors of the run's adapters, in `out`;
    routed experts' adapters as peft's `target_parameters` of transformers v5's fused
    expert tensors (`peft_experts`).

    Raises:
        CheckpointError: an adapter peft cannot name (e.g. of a multi-token prediction module).
    """
    tensors = read_adapters(step_dir)
    experts = {k: t for k, t in tensors.items() if EXPERT_ADAPTERS in k}
    tensors = {k: t for k, t in tensors.items() if k not in experts}
    names = to_peft_names(tensors, config)
    modules = {k.rsplit(".", 2)[0] for k in tensors}
    expert_state, expert_config = {}, {}
    if experts:
        expert_state, expert_config = peft_expert_adapters(
            experts, rank=lora.rank, alpha=lora.alpha, rslora=lora.rslora, prefix=PEFT_PREFIX
        )
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(run_base(folder)[1]),
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "use_rslora": lora.rslora,
        "target_modules": hf_module_names(modules, config),
        **expert_config,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
    state = {names[k]: t.contiguous() for k, t in tensors.items()} | expert_state
    save_file(state, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
