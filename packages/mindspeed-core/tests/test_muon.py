"""Muon and bf16 AdamW moments against torch's own optimizers.

- Newton-Schulz in bf16 is torch's `_zeropower_via_newtonschulz` bit for bit;
- Muon on plain matrices is `torch.optim.Muon`; on a stack `(experts, in, out)` it is
  torch's Muon on each expert's `(out, in)` matrix;
- sharded on equal gradients (two gloo ranks): rows (FSDP2), columns (tensor parallel), a
  stack split along its experts (expert parallel), replicated matrices and a gradient laid
  out otherwise than its parameter step exactly
  as `torch.optim.Muon` on the whole tensors, so the gather-orthogonalise-keep-your-block
  update is one process's (what differs across layouts in training is the gradients'
  summation order, which bf16 Newton-Schulz amplifies: see mindspeed-llm's test);
- bf16 moments: torch's AdamW with its moments rounded to bf16 after each step, the
  moments' bytes halved, and a checkpoint of either dtype loading into the other;
- the default split of a plain module (no `hidden_matrices`) and the refusals.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from mindspeed_core.errors import ConfigError
from mindspeed_core.optim import OptimConfig, build_optimizers
from mindspeed_core.optim.adamw import LowPrecisionAdamW
from mindspeed_core.optim.muon import Muon, hidden_matrices, zeropower_via_newtonschulz
from mindspeed_core.testing import import_sibling, run_distributed

toy = import_sibling(__file__, "toy")
torch_muon = pytest.importorskip("torch.optim._muon")
NS = ((torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C), 5, torch_muon.EPS)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(48, 80), (80, 48), (64, 64)])
def test_newton_schulz_in_bf16_is_torchs(shape):
    grad = _randn(*shape)
    want = torch_muon._zeropower_via_newtonschulz(grad, *NS)
    assert torch.equal(zeropower_via_newtonschulz(grad, *NS), want)
    fp32 = zeropower_via_newtonschulz(grad, *NS, dtype=torch.float32)
    assert fp32.dtype == torch.float32
    torch.testing.assert_close(fp32.bfloat16(), want, atol=0.05, rtol=0)  # same iteration


def _step_pair(params, grads, steps=3):
    """Our Muon and torch's on copies of `params` (plain, 2-D) with the same gradients."""
    ours = [nn.Parameter(p.clone()) for p in params]
    theirs = [nn.Parameter(p.clone()) for p in params]
    a = Muon(ours, lr=0.02, weight_decay=0.1)
    b = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for i in range(steps):
        for p, q, g in zip(ours, theirs, grads, strict=True):
            p.grad, q.grad = g * (i + 1), g * (i + 1)
        a.step()
        b.step()
    return ours, theirs


def test_muon_is_torch_muon_on_matrices_and_on_each_matrix_of_a_stack():
    params, grads = (
        [_randn(24, 40), _randn(40, 24, seed=1)],
        [_randn(24, 40, seed=2), _randn(40, 24, seed=3)],
    )
    ours, theirs = _step_pair(params, grads)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
    # a stack (experts, in, out) is each expert's (out, in) matrix, transposed
    stack, grad = nn.Parameter(_randn(3, 24, 40, seed=4)), _randn(3, 24, 40, seed=5)
    opt = Muon([stack], lr=0.02, weight_decay=0.1)
    expert_params = [nn.Parameter(stack[e].detach().T.clone()) for e in range(3)]
    oracle = torch.optim.Muon(
        expert_params, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"
    )
    for i in range(2):
        stack.grad = grad * (i + 1)
        for e, p in enumerate(expert_params):
            p.grad = grad[e].T * (i + 1)
        opt.step()
        oracle.step()
    for e, p in enumerate(expert_params):
        torch.testing.assert_close(stack[e].detach(), p.detach().T, atol=0, rtol=0)


SHARDED = {  # name: (whole shape, placements on a 1-D mesh of 2[, the gradient's])
    "rows (fsdp)": ((20, 12), [Shard(0)]),
    "columns (tp)": ((12, 20), [Shard(1)]),
    "experts (ep)": ((4, 12, 20), [Shard(0)]),
    "replicated": ((12, 20), [Replicate()]),
    "rows, gradient replicated": ((20, 12), [Shard(0)], [Replicate()]),
}


def _sharded_steps():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for name, (shape, placements, *grad_placements) in SHARDED.items():
        whole, grad = _randn(*shape, seed=7), _randn(*shape, seed=8)
        # (a replicated DTensor's local tensor may be `whole` itself: one copy each)
        p = nn.Parameter(distribute_tensor(whole.clone(), mesh, placements))
        muon = Muon([p], lr=0.02, weight_decay=0.1)
        q = nn.Parameter(distribute_tensor(whole.clone(), mesh, placements))
        adamw = LowPrecisionAdamW([q], lr=0.02, betas=(0.9, 0.95), weight_decay=0.1)
        for i in range(3):
            g = distribute_tensor(grad * (i + 1), mesh, (grad_placements or [placements])[0])
            p.grad, q.grad = g, g.clone()
            muon.step()
            adamw.step()
        momentum = muon.state[p]["momentum_buffer"]
        out[name] = (p.full_tensor(), q.full_tensor(), momentum.placements == p.placements)
    return out


def _plain_steps():
    out = {}
    for name, (shape, *_) in SHARDED.items():
        whole, grad = _randn(*shape, seed=7), _randn(*shape, seed=8)
        p, q = nn.Parameter(whole.clone()), nn.Parameter(whole.clone())
        muon = Muon([p], lr=0.02, weight_decay=0.1)
        adamw = LowPrecisionAdamW([q], lr=0.02, betas=(0.9, 0.95), weight_decay=0.1)
        for i in range(3):
            p.grad, q.grad = grad * (i + 1), grad * (i + 1)
            muon.step()
            adamw.step()
        out[name] = (p.detach(), q.detach())
    return out


@pytest.mark.distributed
@pytest.mark.slow  # CI: mindspeed-llm's test_optim_muon runs the sharded update in training
def test_sharded_muon_and_bf16_adamw_step_exactly_as_on_whole_tensors():
    want = _plain_steps()
    for rank in run_distributed(_sharded_steps, 2):
        for name, (muon, adamw, same_layout) in rank.items():
            assert torch.equal(muon, want[name][0]), name
            assert torch.equal(adamw, want[name][1]), name
            assert same_layout, name  # the momentum is sharded as its parameter
    # and the 2-D plain step is torch.optim.Muon's (the test above), so the sharded one is


def test_bf16_moments_are_torch_adamw_rounded_and_take_half_the_bytes():
    model = toy.make_model()
    batches = toy.make_batches(4)
    oracle = toy.make_model()
    ours = build_optimizers(model, lr=1e-2, weight_decay=0.1, state_dtype="bf16")
    fp32 = build_optimizers(toy.make_model(), lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW([{"params": [p for p in oracle.parameters() if p.dim() >= 2],
                                 "weight_decay": 0.1},
                                {"params": [p for p in oracle.parameters() if p.dim() < 2],
                                 "weight_decay": 0.0}],
                               lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)  # fmt: skip
    for tokens, labels in batches:
        for m, opt in ((model, ours), (oracle, theirs), (fp32.model_parts[0], fp32)):
            F.cross_entropy(m(tokens).flatten(0, 1), labels.flatten()).backward()
            opt.step()
            opt.zero_grad()
        for state in theirs.state.values():  # the oracle's moments, rounded as ours are
            for key in ("exp_avg", "exp_avg_sq"):
                state[key].copy_(state[key].bfloat16())
    for (name, p), q in zip(model.named_parameters(), oracle.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-7, rtol=0, msg=name)
    (adamw,) = ours.optimizers
    for p, q in zip(model.parameters(), oracle.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert adamw.state[p][key].dtype == torch.bfloat16
            torch.testing.assert_close(adamw.state[p][key].float(), theirs.state[q][key],
                                       atol=0, rtol=4e-3)  # fmt: skip
    steps = 4 * sum(1 for _ in model.parameters())  # one fp32 step counter per parameter
    moments = sum(p.numel() for p in model.parameters())
    assert fp32.state_bytes() - steps == 8 * moments
    assert ours.state_bytes() - steps == 4 * moments  # halved


def test_a_checkpoint_of_either_moment_dtype_loads_into_the_other():
    tokens, labels = toy.make_batches(1)[0]

    def trained(state_dtype):
        model = toy.make_model()
        opt = build_optimizers(model, lr=1e-2, state_dtype=state_dtype)
        F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).backward()
        opt.step()
        return opt

    bf16, fp32 = trained("bf16"), trained("fp32")
    fp32.load_state_dict(bf16.state_dict())
    bf16.load_state_dict(trained("fp32").state_dict())
    (a,), (b,) = bf16.optimizers, fp32.optimizers
    assert {s["exp_avg"].dtype for s in a.state.values()} == {torch.bfloat16}
    assert {s["exp_avg"].dtype for s in b.state.values()} == {torch.float32}


def test_plain_modules_split_as_torch_documents_and_muon_settings_are_checked():
    model = toy.make_model()
    names = {n for n, _ in hidden_matrices(model)}
    assert "tok_embeddings.weight" not in names and names  # the embedding stays with AdamW
    assert all(dict(model.named_parameters())[n].dim() == 2 for n in names)
    opt = build_optimizers(model, lr=1e-3, name="muon")
    assert [type(o).__name__ for o in opt.optimizers] == ["AdamW", "Muon"]
    embedding_only = nn.Sequential(nn.Embedding(8, 4), nn.LayerNorm(4))
    with pytest.raises(ConfigError, match=r"optim\.name=muon: no trainable hidden matrix"):
        build_optimizers(embedding_only, lr=1e-3, name="muon")
    with pytest.raises(ConfigError, match=r"optim\.name='sgd'; choose one of \['adamw', 'muon'\]"):
        OptimConfig(name="sgd")
    with pytest.raises(ConfigError, match=r"optim\.state_dtype='fp8'"):
        OptimConfig(state_dtype="fp8")
    with pytest.raises(ConfigError, match=r"optim\.muon_momentum=1\.0 must be"):
        OptimConfig(muon_momentum=1.0)
