"""A LoRA run's base with its adapters merged, one base tensor at a time.

`convert --to hf --merge-lora` (and `logging.hf_export_every` of a LoRA run, which calls it
in the trainer's rank 0) never holds the model: each base tensor is read (from the run's
Hugging Face base folder or the converted checkpoint its `checkpoint.load` named), its
adapter folded in, handed on and dropped. The values are those of
`mindspeed_llm.loading.load_model`, which builds the whole model and calls
`peft.lora.merge_lora`: the base cast to the model's dtype, W + (scaling * B A) with the
factors cast likewise and multiplied in fp32 (`merge_lora`), each routed expert's own
update from `ExpertLoRA.delta` (`merge_expert_adapters`). The adapters themselves (rank r,
a few percent of the model at most) are read once, whole.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from mindspeed_core.errors import CheckpointError
from mindspeed_llm.hf_export.dcp_stream import load_streaming
from mindspeed_llm.loading import ModelSource
from mindspeed_llm.models import checkpoint_io as ckpt
from mindspeed_llm.models import hf_io
from mindspeed_llm.models.registry import get_model_spec
from mindspeed_llm.models.weight_check import check_weights
from mindspeed_llm.peft.checkpoint import read_adapters, run_base
from mindspeed_llm.peft.experts import ExpertLoRA, expert_adapters
from mindspeed_llm.peft.lora import LoRAConfig, adapted_modules, apply_lora

Shapes = dict[str, tuple[torch.dtype, tuple[int, ...]]]


class LoRAMerge:
    """The merged model of a LoRA run's checkpoint `source`, tensor by tensor.

    Everything is checked when it is made (the base's names and shapes, the adapters the
    run's `lora` section implies), before any base tensor is read.

    Raises:
        ConfigError: `lora.targets` match no layer of the model.
        CheckpointError: no base; the base lacks a tensor or holds one of another shape;
            the checkpoint lacks an adapter (each named).
    """

    def __init__(self, source: ModelSource, lora: LoRAConfig):
        self.config = config = source.config
        # the model `load_model` builds, on the meta device: our names, dtypes and shapes
        with torch.device("meta"):
            model = get_model_spec(config.family).build(config)
        if config.dtype is not None:
            model.to(getattr(torch, config.dtype))
        self.shapes: Shapes = {n: (t.dtype, tuple(t.shape)) for n, t in model.state_dict().items()}
        """Our name -> (dtype, shape) of every tensor of the merged model, in its order."""
        with torch.device("meta"):
            apply_lora(model, lora)
        names = {id(p): n for n, p in model.named_parameters()}
        self._adapters: dict[str, tuple[str, str, bool]] = {}  # weight -> (A, B, experts?)
        for name, linear in adapted_modules(model):
            a, b = names[id(linear.lora_A.weight)], names[id(linear.lora_B.weight)]
            self._adapters[f"{name}.weight"] = (a, b, False)
        for name, adapter in expert_adapters(model):
            self._adapters[name] = (names[id(adapter.lora_A)], names[id(adapter.lora_B)], True)
        self._scaling = lora.scaling
        factors = read_adapters(source.weights)
        wanted = {n for n in names.values() if ".lora_" in n}
        if wanted - set(factors):
            raise CheckpointError(
                f"{source.weights} lacks adapter {sorted(wanted - set(factors))[0]} of "
                f"lora.targets={lora.targets}"
            )
        self._factors = {n: factors[n] for n in wanted}
        self._kind, self._base = run_base(source.path)
        self._weights = self._check_base()

    def _check_base(self) -> hf_io.HFWeights | Shapes:
        """The base's reader (a Hugging Face folder) or stored shapes (a DCP step), checked
        to hold every tensor of the model in its shape."""
        if self._kind == "hf":
            weights = hf_io.HFWeights(self._base, self.config)
            check_weights(self._base, weights.shapes, self.shapes, weights.renamed)
            stored = weights.shapes
        else:
            weights = stored = ckpt.tensor_metadata(self._base)
        missing = sorted(set(self.shapes) - set(stored))
        if missing:
            raise CheckpointError(
                f"{self._base}: the model has tensors the checkpoint lacks: {missing[:5]}"
            )
        for name, (_, shape) in self.shapes.items():
            if tuple(stored[name][1]) != shape:
                raise CheckpointError(
                    f"{self._base}: {name} has shape {tuple(stored[name][1])} in the checkpoint "
                    f"but {shape} in the model"
                )
        return weights

    def stream(self, put: Callable[[str, torch.Tensor], None]) -> None:
        """`put(our name, merged tensor)` for every tensor of the model, one at a time."""
        if self._kind == "hf":
            for name, tensor in self._weights.items():
                if name in self.shapes:
                    put(name, self.merge(name, tensor))
            return
        prefix = ckpt.MODEL_KEY + "."

        def done(fqn: str, tensor: torch.Tensor) -> None:
            name = fqn[len(prefix) :]
            put(name, self.merge(name, tensor))

        load_streaming(Path(self._base), {prefix + n: self._weights[n] for n in self.shapes}, done)

    @torch.no_grad()
    def merge(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Base tensor `name` in the model's dtype, its adapter (if any) folded in."""
        dtype = self.shapes[name][0]
        adapter = self._adapters.get(name)
        if adapter is None:
            return tensor.to(dtype)
        a, b = (self._factors[n].to(dtype) for n in adapter[:2])
        weight = tensor.to(dtype, copy=True)
        if adapter[2]:  # stacked experts: (experts, in, out), as merge_expert_adapters
            delta = ExpertLoRA(a, b, scaling=self._scaling, dropout=0.0, impl="reference").delta()
        else:  # as merge_lora: (out, in)
            delta = (b.float() @ a.float()).mul_(self._scaling)
        return weight.add_(delta.to(dtype))
