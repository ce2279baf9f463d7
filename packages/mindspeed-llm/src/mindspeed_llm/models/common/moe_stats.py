"""The model-wide view of its MoE blocks (`moe.MoE`): the auxiliary loss of the last
forward, the expert loads over a step, and the parameters one token uses.

Each `MoE` keeps the `RouterStats` of its last forward in `last_stats`; `moe_aux_loss(model)`
combines them right after the forward, before backward (no change of the model's return
value, so it works with FSDP, recompute and pipeline stages). `LoadTracker` accumulates the
expert loads over a step for the metrics and for the aux-loss-free bias update.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mindspeed_core.training import dense_params, moe_active_params
from mindspeed_llm.models.common.moe import MoE, layer_aux_loss, load_balancing_loss
from mindspeed_llm.models.config import TransformerConfig

__all__ = ["LoadTracker", "active_params", "moe_aux_loss", "moe_layers"]


def moe_layers(model: nn.Module | list[nn.Module] | None) -> dict[str, MoE]:
    """The MoE blocks of `model` (or of every pipeline stage in a list) by module name
    (empty for a dense model). Stages keep the whole model's names, so names stay unique."""
    parts = model if isinstance(model, list | tuple) else [model]
    return {
        n: m for p in parts if p is not None for n, m in p.named_modules() if isinstance(m, MoE)
    }


def moe_aux_loss(model: nn.Module, config: TransformerConfig) -> Tensor | None:
    """The weighted auxiliary loss of the last forward (None for a dense model or no coef).

    router_aux_loss_coef * load balancing + router_z_loss_coef * mean z-loss over layers;
    the load balancing pooled over all layers or per layer (`router_aux_loss_scope`).
    Call after the forward and before backward; add the result to the training loss.
    None too when the blocks attach their aux loss themselves (pipeline parallel).
    """
    layers = [m for m in moe_layers(model).values() if m.last_stats is not None]
    if not layers or any(m.attach_aux for m in layers):
        return None
    if not (config.router_aux_loss_coef or config.router_z_loss_coef):
        return None
    if config.router_aux_loss_scope == "layer":
        return torch.stack([layer_aux_loss(m.last_stats, m) for m in layers]).mean()
    stats = [m.last_stats for m in layers]
    loss = config.router_z_loss_coef * torch.stack([s.z_loss for s in stats]).mean()
    if config.router_aux_loss_coef:
        balance = load_balancing_loss(stats, config.num_experts, layers[0].token_group)
        loss = loss + config.router_aux_loss_coef * balance
    return loss


class LoadTracker:
    """Expert loads over a training step: metrics, and the aux-loss-free bias update.

    Call `observe(aux_loss)` after every forward (micro-batch), `step(group)` after the
    optimizer step: it sums the loads over `group` (all data-parallel ranks, so every
    rank applies the same bias update), updates the router biases and returns metrics:
    the load of each layer's experts as fractions of its assignments (`moe_load`), the
    highest and lowest load relative to a balanced one (1.0), dropped assignments, and
    the mean aux loss.

    Pipeline parallel (`model` a list of this rank's stages, `pp_group` given): the
    schedule runs the forwards, so the tracker notes each block's statistics in a forward
    hook instead, and `step` also sums over the stages, so every rank reports every
    layer (and the aux loss, each stage's layers' share summed).
    """

    def __init__(
        self,
        model: nn.Module | list[nn.Module],
        bias_update_rate: float = 0.0,
        *,
        pp_group: dist.ProcessGroup | None = None,
        num_experts: int | None = None,
        device: torch.device | str = "cpu",
    ):
        """`num_experts` and `device` matter for a pipeline stage without MoE blocks."""
        self.layers = moe_layers(model)
        self.device = torch.device(device)
        if self.layers:
            num_experts = next(iter(self.layers.values())).num_experts
            self.device = next(iter(self.layers.values())).router.weight.device
        self.num_experts = num_experts
        self.bias_update_rate = bias_update_rate
        self.pp_group = pp_group
        self._loads: Tensor | None = None
        self._dropped = self._observed = 0
        self._aux = 0.0
        self._names: list[str] | None = None
        if pp_group is not None:
            for layer in self.layers.values():
                layer.accumulate_stats = True
                layer.step_stats.zero_()  # a model materialised without init_weights

    def observe(self, aux_loss: Tensor | None = None) -> None:
        stats = [m.last_stats for m in self.layers.values()]
        if not stats or any(s is None for s in stats):
            return
        loads = torch.stack([s.tokens_per_expert for s in stats])  # (layers, experts)
        self._loads = loads if self._loads is None else self._loads + loads
        self._dropped += sum(s.num_dropped for s in stats)
        self._observed += 1
        if aux_loss is not None:
            self._aux = self._aux + aux_loss.detach().float()

    def step(self, group: dist.ProcessGroup | None = None) -> dict[str, float | list]:
        """Reduce, update biases, reset; the metrics of the step (empty if nothing seen)."""
        if self.pp_group is not None:
            self._take_accumulated()
        elif self._loads is None:
            return {}
        loads, (dropped, observed, aux) = self._reduce(group)
        self._loads, self._dropped, self._observed, self._aux = None, 0, 0, 0.0
        if self.bias_update_rate:
            for name, layer in self.layers.items():
                layer.router.update_bias(loads[name], self.bias_update_rate)
        if not observed:
            return {}
        table = torch.stack([loads[n] for n in sorted(loads, key=_layer_order)])
        fractions = table / table.sum(dim=1, keepdim=True)  # (layers, experts), rows sum to 1
        relative = fractions * table.shape[1]  # 1 = perfectly balanced
        return {
            "moe_max_load": float(relative.max()),
            "moe_min_load": float(relative.min()),
            "moe_dropped_tokens": int(dropped),
            "moe_aux_loss": aux / observed,
            "moe_load": [[round(float(v), 4) for v in row] for row in fractions],
        }

    def _take_accumulated(self) -> None:
        """Pipeline parallel: the step's statistics from the blocks' buffers, which restart."""
        if not self.layers:
            return
        table = torch.stack([layer.step_stats for layer in self.layers.values()])
        for layer in self.layers.values():
            layer.step_stats.zero_()
        self._loads = table[:, : self.num_experts]
        self._dropped = float(table[:, -3].sum())
        self._observed = float(table[:, -2].max())
        self._aux = float(table[:, -1].sum())

    def _all_layer_names(self) -> list[str]:
        """The MoE blocks of every stage, in layer order (asked of the stages once)."""
        if self.pp_group is None:
            return list(self.layers)
        if self._names is None:
            gathered: list = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(gathered, list(self.layers), group=self.pp_group)
            self._names = sorted({n for stage in gathered for n in stage}, key=_layer_order)
        return self._names

    def _reduce(self, group) -> tuple[dict[str, Tensor], list[float]]:
        """Loads of every layer by name, and (dropped, micro-batches, aux sum), summed over
        `group` and, under pipeline parallel, over the stages."""
        names = self._all_layer_names()
        loads = torch.zeros(len(names), self.num_experts, device=self.device)
        if self._loads is not None:
            mine = [names.index(n) for n in self.layers]
            loads[mine] = self._loads.to(loads)
        counters = loads.new_tensor([self._dropped, float(self._aux), self._observed])
        values = torch.cat([loads.flatten(), counters])
        for g in (group, self.pp_group):
            if g is not None:
                dist.all_reduce(values[:-1], group=g)
        if group is not None:
            dist.all_reduce(values[-1:], group=group)
        if self.pp_group is not None:  # a stage without MoE blocks observed nothing
            dist.all_reduce(values[-1:], op=dist.ReduceOp.MAX, group=self.pp_group)
        rows = values[:-3].view(len(names), -1)
        dropped, aux, observed = values[-3:].tolist()
        return dict(zip(names, rows, strict=True)), [dropped, observed, aux]


def _layer_order(name: str) -> tuple:
    """Module names sorted by their layer number ("layers.10..." after "layers.9...")."""
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))


def active_params(model: nn.Module) -> int:
    """Matmul parameters one token uses: all but the embedding, with only top_k of each
    MoE layer's routed experts (for FLOPs and MFU)."""
    total = dense_params(model)
    layers = moe_layers(model).values()
    if not layers:
        return total
    first = next(iter(layers))
    experts = sum(p.numel() for m in layers for p in m.experts.parameters())
    return moe_active_params(total, experts, first.num_experts, first.top_k)
