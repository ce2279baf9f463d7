"""`train.compile`: whether a run compiles its blocks (auto, on, off), and why a model cannot.

Each block compiles as one graph (`mindspeed_core.parallel.apply_compile(fullgraph=True)`):
what the graph cannot hold (a host read of a value, an output shaped by values) would split
it, and the first call would fail. Blocks built from attention (packed documents through the
custom attention op, MLA, DeepSeek's sparse attention, sinks, sliding windows), dense
feed-forwards and dropless MoE routing compile; the rest is named here and runs eager.
"""

from __future__ import annotations

import logging

import torch

from mindspeed_core.errors import ConfigError
from mindspeed_llm.models.config import TransformerConfig

logger = logging.getLogger("mindspeed.train")

__all__ = ["check_cuda_graphs", "compile_blocker", "compile_mode", "resolve_compile"]

COMPILED_DEVICES = ("cuda", "npu")
"""Where `train.compile: auto` compiles (on CPU compiling takes minutes, most runs less)."""


def compile_blocker(config: TransformerConfig) -> str | None:
    """Why `config`'s blocks cannot compile as one graph, or None when they can."""
    if config.linear_attention_layers:
        return ("its gated DeltaNet layers run the chunked delta rule, a Python loop over the "
                "documents' host boundaries")  # fmt: skip
    if config.num_experts and config.capacity_factor is not None:
        return "MoE's capacity limit counts the dropped tokens on the host"
    return None


def resolve_compile(mode: str | bool, device: torch.device, config: TransformerConfig) -> bool:
    """Whether this run compiles its blocks: `mode` ("auto": on CUDA and NPU, "on", "off";
    or a bool), unless the model cannot (then one log line says why)."""
    if isinstance(mode, bool):
        mode = "on" if mode else "off"
    wanted = mode == "on" or (mode == "auto" and torch.device(device).type in COMPILED_DEVICES)
    if not wanted:
        return False
    reason = compile_blocker(config)
    if reason is not None:
        logger.warning("train.compile=%s: %s blocks run eager: %s", mode, config.family, reason)
        return False
    return True


def check_cuda_graphs(cuda_graphs: bool, mode: str | bool, device: torch.device,
                      config: TransformerConfig) -> None:  # fmt: skip
    """`train.cuda_graphs`: refused, naming the field, where no graph can be recorded: no CUDA
    device, compilation off, or a model whose blocks do not compile (`compile_blocker`)."""
    if not cuda_graphs:
        return
    device = torch.device(device)
    if device.type != "cuda":
        raise ConfigError(f"train.cuda_graphs=true needs a CUDA device; this run's is {device.type}")
    if mode in ("off", False):
        raise ConfigError("train.cuda_graphs=true replays the compiled blocks: set train.compile "
                          "auto or on")  # fmt: skip
    reason = compile_blocker(config)
    if reason is not None:
        raise ConfigError(f"train.cuda_graphs=true: {config.family} blocks do not compile: {reason}")


def compile_mode(mode: str | bool, cuda_graphs: bool, device: torch.device,
                 config: TransformerConfig) -> str | None:  # fmt: skip
    """torch.compile's mode for the blocks ("default"; "reduce-overhead": CUDA graphs), or
    None to run eager (see `resolve_compile`, `check_cuda_graphs`)."""
    check_cuda_graphs(cuda_graphs, mode, device, config)
    if not resolve_compile(mode, device, config):
        return None
    return "reduce-overhead" if cuda_graphs else "default"
