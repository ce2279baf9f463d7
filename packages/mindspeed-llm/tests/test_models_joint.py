"""Training under autocast runs attention's wq/wk/wv and the feed-forward's w1/w3 as one matmul
each (and RoPE once over q's and k's heads): the loss and gradients of the layers one by one,
which is what a layer with a hook (LoRA), no gradient or no autocast (fp32: the concatenated
weights would be an extra copy kept for the backward) still runs."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mindspeed_llm.models import Transformer, build_model_config
from mindspeed_llm.models.common import linear as linear_module

JOINED = ("wq", "wk", "wv", "w1", "w3")


class _Matmuls(TorchDispatchMode):
    """Counts the matmuls dispatched."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm)
        return func(*args, **(kwargs or {}))


def _loss_and_grads(model, tokens, cu_seqlens, autocast=True):
    model.zero_grad()
    with _Matmuls() as matmuls, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens, cu_seqlens=cu_seqlens)
    loss = logits.float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, matmuls.count


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_joint_projections_match_the_layers_one_by_one(family):
    torch.manual_seed(0)
    model = Transformer(build_model_config(family, flavor="debug"))
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    cu_seqlens = torch.tensor([0, 5, 16, 25, 32], dtype=torch.int32)
    loss, grads, joined = _loss_and_grads(model, tokens, cu_seqlens)
    hooks = [m.register_forward_hook(lambda *a: None) for n, m in model.named_modules()
             if n.rsplit(".", 1)[-1] in JOINED]  # fmt: skip
    loss_apart, grads_apart, apart = _loss_and_grads(model, tokens, cu_seqlens)
    for hook in hooks:
        hook.remove()
    # each block: qkv, wo, [w1; w3], w2 against seven matmuls; then the output layer
    assert (joined, apart) == (4 * model.config.num_layers + 1, 7 * model.config.num_layers + 1)
    # bf16 products: the joined GEMM's and the three's rounding may differ in the last bit
    torch.testing.assert_close(loss, loss_apart, atol=1e-3, rtol=1e-3)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_apart[name], atol=2e-3, rtol=2e-2, msg=name)
    *_, fp32 = _loss_and_grads(model, tokens, cu_seqlens, autocast=False)
    assert fp32 == 7 * model.config.num_layers + 1  # no autocast: one by one


def test_no_gradient_runs_the_layers_one_by_one():
    model = Transformer(build_model_config("llama", flavor="debug"))
    x = torch.randn(1, 4, model.config.hidden_size)
    attention = model.layers["0"].attention
    layers = (attention.wq, attention.wk, attention.wv)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear_module.joint_projection(x, layers) is not None
        with torch.no_grad():
            assert linear_module.joint_projection(x, layers) is None
    assert linear_module.joint_projection(x, layers) is None  # fp32
