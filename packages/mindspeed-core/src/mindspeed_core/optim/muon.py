"""Muon on sharded parameters: torch's `torch.optim.Muon` update, the matrix gathered whole.

Muon (Keller Jordan; "Muon is Scalable for LLM Training", Moonshot AI) updates a hidden
layer's weight matrix with the Newton-Schulz orthogonalisation of its (Nesterov) momentum.
The update here is `torch.optim.Muon`'s, step for step, with torch's own Newton-Schulz
iteration and learning-rate adjustment (`torch.optim._muon`), so one process equals torch's
optimizer exactly. What torch's optimizer does not do is a sharded parameter: the
orthogonalisation needs the whole matrix, while FSDP2 and tensor parallel leave each rank a
block of it. Here, as in Moonshot's Distributed Muon:

- the momentum lives in the parameter's layout (a DTensor with the parameter's placements,
  so it checkpoints under the parameter's name and reshards with DCP like AdamW's moments);
- a matrix split inside its two matrix dimensions (FSDP's rows, a tensor-parallel shard) is
  gathered whole on every rank of its mesh (one all-gather of the update), orthogonalised
  there, and each rank keeps its own block. Every rank computes the same whole update from
  the same numbers, so the result equals one process's whatever the layout;
- a stack of matrices (`(experts, in, out)`, the grouped-GEMM convention `x @ W`) split
  only along the stack (expert parallel) is orthogonalised where it lies, matrix by matrix:
  no communication, and exactly one process's result too.

The price of the gather is one matrix's all-gather per step and every rank of the mesh
orthogonalising every matrix of its shard group (the work is repeated, not divided);
Moonshot's and torchtitan's later variants spread the matrices over the ranks instead.

Which parameters are matrices to orthogonalise is the model's to say (`hidden_matrices`):
Muon is meant for hidden layers, not the embedding or the output head.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from mindspeed_core.errors import ConfigError
from mindspeed_core.optim.adamw import PerParameterStep, grad_like_param
from mindspeed_core.parallel.materialize import local_box

ADJUST_LR = ("match_rms_adamw", "original", "spectral_unclamped")
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def hidden_matrices(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters of `module` that Muon orthogonalises, by name.

    A module says which with a method ``hidden_matrices() -> Iterable[str]`` (parameter
    names: the 2-D weights of its blocks' projections and 3-D stacks of expert matrices,
    never the embedding, the output head, norms, biases or routers). Without one, the rule
    of torch's `torch.optim.Muon` documentation: every 2-D parameter except the weights of
    `nn.Embedding` modules (and what is tied to them).
    """
    params = dict(module.named_parameters())
    method = getattr(module, "hidden_matrices", None)
    if callable(method):
        names = list(method())
    else:
        embedded = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
        names = [n for n, p in params.items() if p.dim() == 2 and id(p) not in embedded]
    out = []
    for name in names:
        param = params.get(name)
        if param is None or not param.requires_grad:
            continue  # frozen (a LoRA base), or a shared weight listed under another name
        if param.dim() not in (2, 3):
            raise ConfigError(f"optim.name=muon: {name} of shape {tuple(param.shape)} is no matrix")
        out.append((name, param))
    return out


def _torch_muon():
    """torch's Newton-Schulz iteration and LR adjustment (torch >= 2.9)."""
    try:
        from torch.optim import _muon
    except ImportError:
        raise ConfigError(
            f"optim.name=muon needs torch >= 2.9 (torch.optim.Muon); this is torch {torch.__version__}"
        ) from None
    return _muon


class Muon(PerParameterStep, Optimizer):
    """`torch.optim.Muon` for plain and DTensor parameters, 2-D or stacks of matrices (3-D).

    Args are `torch.optim.Muon`'s, plus `ns_dtype`, the dtype of the Newton-Schulz
    iteration: "bf16" (torch's) or "fp32". `adjust_lr_fn` defaults to Moonshot's "match_rms_adamw"
    (the update's RMS matched to AdamW's, so Muon shares AdamW's learning rate and weight
    decay). For a 3-D stack each matrix is `(in, out)` and the adjustment sees its shape
    as `(out, in)`, torch's `nn.Linear` convention.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: str = "match_rms_adamw",
        eps: float | None = None,
        ns_dtype: str = "bf16",
    ):
        muon = _torch_muon()
        if ns_dtype not in NS_DTYPES:
            raise ConfigError(f"muon ns_dtype={ns_dtype!r}; choose one of {list(NS_DTYPES)}")
        if adjust_lr_fn not in ADJUST_LR:
            raise ConfigError(
                f"muon adjust_lr_fn={adjust_lr_fn!r}; choose one of {list(ADJUST_LR)}"
            )
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": (muon.DEFAULT_A, muon.DEFAULT_B, muon.DEFAULT_C),
            "eps": muon.EPS if eps is None else eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_dtype": ns_dtype,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() not in (2, 3):
                    raise ConfigError(
                        f"Muon takes matrices or stacks of them, not {tuple(p.shape)}"
                    )

    def _update(self, p: Tensor, group: dict[str, Any]) -> None:
        # `torch.optim._muon._single_tensor_muon`, with the orthogonalisation layout-aware.
        state = self.state[p]
        grad = grad_like_param(p)  # so the momentum and its blocks follow the parameter's
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf, momentum = state["momentum_buffer"], group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        ortho = self._orthogonalize(update, group)  # this rank's block, a plain tensor
        lr = group["lr"]
        rows, cols = p.shape[-2:]
        shape = (rows, cols) if p.dim() == 2 else (cols, rows)  # a stack: (in, out) each
        adjusted = _torch_muon()._adjust_lr(lr, group["adjust_lr_fn"], torch.Size(shape))
        local = p.to_local() if isinstance(p, DTensor) else p
        local.mul_(1 - lr * group["weight_decay"])
        local.add_(ortho.to(local.dtype), alpha=-adjusted)

    def _orthogonalize(self, update: Tensor, group: dict[str, Any]) -> Tensor:
        """Newton-Schulz of each matrix of `update`, as this rank's block (a plain tensor)."""
        if isinstance(update, DTensor) and not _whole_matrices(update):
            whole = _newton_schulz(update.full_tensor(), group)
            return local_box(update).of(whole)
        local = update.to_local() if isinstance(update, DTensor) else update
        return _newton_schulz(local, group)


def _whole_matrices(t: DTensor) -> bool:
    """Whether this rank's block of `t` holds whole matrices (split along a stack only, or
    replicated)."""
    return tuple(local_box(t).sizes[-2:]) == tuple(t.shape[-2:])


def _newton_schulz(x: Tensor, group: dict[str, Any]) -> Tensor:
    """The orthogonalisation of a matrix, or of each matrix of a stack."""
    dtype = NS_DTYPES[group["ns_dtype"]]
    args = (group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
    if x.dim() == 2:
        return zeropower_via_newtonschulz(x, *args)
    return torch.stack([zeropower_via_newtonschulz(m, *args) for m in x]) if len(x) else x


def zeropower_via_newtonschulz(
    grad: Tensor,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """`torch.optim._muon._zeropower_via_newtonschulz` (Keller Jordan's quintic iteration)
    computed in `dtype`: bf16 is torch's, bit for bit; fp32 lets layouts agree to fp32's
    rounding. The iteration multiplies small singular values by up to ~a^steps (~480), so
    in bf16 a last-bit difference of the input (a gradient summed in another order) shows
    in the update; in fp32 it stays near fp32's rounding."""
    a, b, c = ns_coefficients
    ortho = grad.to(dtype, copy=True)
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, update, ortho, beta=a)
    return ortho.T if grad.size(0) > grad.size(1) else ortho


def check_muon_args(momentum: float, ns_steps: int, *, section: str = "optim") -> None:
    """Refuse Muon settings torch would reject or that cannot converge."""
    if not (isinstance(momentum, int | float) and math.isfinite(momentum) and 0 <= momentum < 1):
        raise ConfigError(f"{section}.muon_momentum={momentum} must be a number in [0, 1)")
    if not (isinstance(ns_steps, int) and 1 <= ns_steps < 100):
        raise ConfigError(f"{section}.muon_ns_steps={ns_steps} must be an integer in [1, 100)")
