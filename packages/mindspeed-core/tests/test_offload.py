"""Activation offload: the same losses and gradients bit for bit, exactly the blocks' saved
activations go through host memory, bad combinations refused; on a GPU the peak falls."""

import pytest
import torch
import torch.nn.functional as F

from mindspeed_core.errors import ParallelError
from mindspeed_core.memory import offload_activations
from mindspeed_core.parallel import apply_ac
from mindspeed_core.testing import import_sibling, requires_device

toy = import_sibling(__file__, "toy")


def _train(device, offload: bool, steps: int = 3):
    model = toy.make_model().to(device)
    hooks = offload_activations(model, allow_cpu=True) if offload else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads, offloaded = [], [], []
    for tokens, labels in toy.make_batches(steps, batch=8):
        loss = F.cross_entropy(model(tokens.to(device)).flatten(0, 1), labels.to(device).flatten())
        loss.backward()
        losses.append(loss.detach().cpu())
        grads.append([p.grad.detach().cpu().clone() for p in model.parameters()])
        offloaded.append(hooks.stats.bytes if hooks else 0)
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, offloaded


def _saved_block_bytes() -> int:
    """Bytes of the distinct tensors (views) the toy model's blocks save for backward,
    parameters excepted, seen by a plain probe."""
    model = toy.make_model()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params and t.numel() * t.element_size() >= 1024:
            view = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride())
            storages[view] = (t.numel() * t.element_size(), t)  # held: no address reuse
        return t

    tokens, _ = toy.make_batches(1, batch=8)[0]
    h = model.tok_embeddings(tokens)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for layer in model.layers:
            h = layer(h, model.rope)
    return sum(size for size, _ in storages.values())


def test_offload_is_exact_and_moves_the_saved_activations():
    base_losses, base_grads, _ = _train("cpu", offload=False)
    losses, grads, offloaded = _train("cpu", offload=True)
    for a, b in zip(base_losses, losses, strict=True):
        assert torch.equal(a, b)
    for step_a, step_b in zip(base_grads, grads, strict=True):
        for a, b in zip(step_a, step_b, strict=True):
            assert torch.equal(a, b)
    # views of one storage (q/k/v after reshapes) are separate copies: at least the storages
    assert offloaded[0] == _saved_block_bytes() > 0
    assert offloaded == [offloaded[0]] * len(offloaded)


def test_offload_refusals():
    with pytest.raises(ParallelError, match="already on the CPU"):
        offload_activations(toy.make_model())
    model = apply_ac(toy.make_model(), "full")
    with pytest.raises(ParallelError, match="recompute"):
        offload_activations(model, allow_cpu=True)


@requires_device("cuda")
def test_offload_lowers_gpu_peak():
    device = torch.device("cuda")

    def peak(offload):
        torch.cuda.reset_peak_memory_stats()
        out = _train(device, offload, steps=2)
        return torch.cuda.max_memory_allocated(), out

    base_peak, (base_losses, _, _) = peak(False)
    off_peak, (losses, _, _) = peak(True)
    assert all(torch.equal(a, b) for a, b in zip(base_losses, losses, strict=True))
    assert off_peak < base_peak
