"""`build_model`: the hooks run where they must (a new head before TP, adapters after TP
and before FSDP), a value head gives one process's values under tp=2, and a frozen copy
is a reference model: the policy's weights, no gradients, eval mode."""

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from mindspeed_core.optim import OptimConfig
from mindspeed_core.parallel import ParallelConfig
from mindspeed_core.testing import run_distributed
from mindspeed_llm.models import build_model_config
from mindspeed_llm.train.build import build_model, build_train_parts

SEQ = 16


def _build(parallel: ParallelConfig, world_size=None, **hooks):
    dims = parallel.dims(world_size).build("cpu")
    config = build_model_config("llama", flavor="debug", ops_impl="reference")
    return build_model(config, dims, torch.device("cpu"), parallel=parallel, seq_len=SEQ, **hooks)


def _tokens():
    return torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(0))


def test_a_frozen_copy_is_the_policy_without_gradients():
    policy = _build(ParallelConfig())
    reference = _build(ParallelConfig(), frozen=True)
    assert all(p.requires_grad for p in policy.model.parameters())
    assert not any(p.requires_grad for p in reference.model.parameters())
    assert not reference.model.training and reference.router is None
    with torch.no_grad():
        torch.testing.assert_close(reference.model(_tokens()), policy.model(_tokens()))


def _value_head(model: nn.Module, dims) -> None:
    """before_tp: a reward model's head, drawn from the run's random stream."""
    assert not isinstance(model.output.weight, DTensor)  # nothing is parallel yet
    model.output = nn.Linear(model.config.hidden_size, 1, bias=False)


def _freeze_embeddings(seen: list):
    def hook(model: nn.Module, dims) -> None:  # after_tp: where LoRA would be injected
        wq = model.layers["0"].attention.wq.weight
        seen.append(
            (type(wq).__name__, getattr(wq, "placements", None), isinstance(model, FSDPModule))
        )
        model.tok_embeddings.weight.requires_grad_(False)

    return hook


def _hooks():
    tokens, target = _tokens(), torch.randn(2, SEQ, 1, generator=torch.Generator().manual_seed(1))
    out = {}
    for name, parallel in {"one": (ParallelConfig(), 1), "tp2": (ParallelConfig(tp=2, loss_parallel=False), None),
                           "dp_shard2": (ParallelConfig(dp_shard=2), None)}.items():  # fmt: skip
        seen = []
        model = _build(*parallel, before_tp=_value_head, after_tp=_freeze_embeddings(seen))
        parts = build_train_parts(model, OptimConfig(lr=1e-2, warmup_steps=0), total_steps=1)
        embedding = _full(model.model.tok_embeddings.weight)
        values = model.model(tokens)
        torch.nn.functional.mse_loss(values, target).backward()
        head_grad = _full(model.model.output.weight.grad)
        parts.optimizer.step()
        unchanged = torch.equal(_full(model.model.tok_embeddings.weight), embedding)
        fsdp = isinstance(model.model, FSDPModule)
        out[name] = (_full(values).detach(), head_grad, seen, unchanged, fsdp)
    return out


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.mark.distributed
def test_hooks_run_before_tp_and_after_tp_before_fsdp():
    for result in run_distributed(_hooks, 2, timeout=300):
        want_values, want_grad = result["one"][:2]
        assert want_values.shape == (2, SEQ, 1)
        for name, (values, grad, seen, unchanged, fsdp) in result.items():
            torch.testing.assert_close(values, want_values, atol=1e-6, rtol=1e-5, msg=name)
            torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5, msg=name)
            assert unchanged, f"{name}: a parameter frozen by after_tp was updated"
            assert seen[0][2] is False, f"{name}: after_tp ran after FSDP"
            assert fsdp == (name == "dp_shard2"), name
        assert result["tp2"][2][0][:2] == ("DTensor", (Shard(0),))  # after TP
        assert result["one"][2][0][0] == "Parameter" and result["dp_shard2"][2][0][0] == "Parameter"
