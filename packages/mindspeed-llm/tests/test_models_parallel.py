"""Parallel layouts of the dense models give one process's logits and gradients (fp32, 2 gloo
ranks, one spawn): tensor parallel with and without sequence/loss parallel, packed
documents under TP, Qwen2 biases and Qwen3 qk-norm under TP, FSDP with recompute; and a
model built on the meta device, sharded by FSDP, then materialised and initialised."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from mindspeed_core.errors import ParallelError
from mindspeed_core.optim import clip_grad_norm_
from mindspeed_core.parallel import ParallelDims, loss_parallel_context
from mindspeed_core.testing import run_distributed
from mindspeed_llm.models import build_model_config, get_model_spec
from mindspeed_llm.models.common import RMSNorm
from mindspeed_llm.models.common.tp_plan import llama_tp_plan

ATOL = 1e-5
LAYOUTS = {
    "llama_tp2": ("llama", {"tp": 2}, {}),
    "llama_tp2_sp": ("llama", {"tp": 2}, {"sequence_parallel": True}),
    "llama_tp2_sp_loss_parallel": (
        "llama",
        {"tp": 2},
        {"sequence_parallel": True, "loss_parallel": True},
    ),
    "llama_tp2_sp_packed": ("llama", {"tp": 2}, {"sequence_parallel": True}),
    "qwen2_tp2_sp": ("qwen2", {"tp": 2}, {"sequence_parallel": True}),
    "qwen3_tp2_selective_ac": ("qwen3", {"tp": 2}, {"ac_mode": "selective"}),
    "mistral_fsdp2_full_ac": ("mistral", {"dp_shard": 2}, {"ac_mode": "full"}),
}
CU_SEQLENS = torch.tensor([0, 5, 16, 30, 32], dtype=torch.int32)  # over 2 rows of 16


def _batch():
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 512, (2, 16), generator=gen), torch.randint(
        0, 512, (2, 16), generator=gen
    )


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _run(family, degrees=None, options=None, packed=False):
    """Logits and gradients of one step; no degrees: the one-process reference."""
    spec = get_model_spec(family)
    torch.manual_seed(0)
    model = spec.build(build_model_config(family, flavor="debug"))
    options = options or {}
    if degrees is not None:
        model = spec.parallelize(model, ParallelDims(**degrees).build(), **options)
    tokens, labels = _batch()
    kwargs = {"cu_seqlens": CU_SEQLENS} if packed else {}
    with loss_parallel_context(options.get("loss_parallel", False)):
        logits = model(tokens, **kwargs)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    # one clipped SGD step: Partial gradients (norm weights) must reduce inside the update
    norm = clip_grad_norm_(model.parameters(), max_norm=0.5)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    params = {n: _full(p) for n, p in model.named_parameters()}
    return {
        "logits": _full(logits),
        "loss": _full(loss),
        "norm": _full(norm),
        "grads": grads,
        "params": params,
    }


def _rms_norm_on_sequence_shards():
    """RMSNorm on a DTensor sharded along the sequence == on the whole tensor."""
    mesh = ParallelDims(tp=2).build().mesh("tp")
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16, requires_grad=True)
    plain = RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
    sharded = RMSNorm(16, eps=1e-6)
    sharded.weight = torch.nn.Parameter(
        distribute_tensor(plain.weight.detach(), mesh, [Replicate()])
    )
    x_shard = distribute_tensor(x.detach(), mesh, [Shard(1)]).requires_grad_()
    out = sharded(x_shard)
    assert isinstance(out, DTensor) and out.placements == (Shard(1),)
    out.full_tensor().pow(2).sum().backward()
    plain(x).pow(2).sum().backward()
    return {
        "out": (_full(out), plain(x).detach()),
        "x_grad": (_full(x_shard.grad), x.grad),
        "w_grad": (_full(sharded.weight.grad), plain.weight.grad),
    }


def _meta_then_fsdp_then_init():
    """torchtitan's flow: build on meta, parallelise, materialise, initialise in place."""
    config = build_model_config("qwen2", flavor="debug")
    spec = get_model_spec("qwen2")
    with torch.device("meta"):
        model = spec.build(config)
    spec.parallelize(model, ParallelDims(dp_shard=2).build())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    logits = model(_batch()[0])
    weight = model.layers["0"].attention.wq.weight
    assert isinstance(weight, DTensor) and weight.to_local().shape == (32, 64)
    assert torch.isfinite(logits).all() and logits.shape == (2, 16, 512)
    assert abs(_full(weight).std().item() - config.init_std) < 3e-3
    assert torch.all(_full(model.layers["1"].attention.wk.bias) == 0)
    torch.testing.assert_close(model.rope_cos, spec.build(config).rope_cos, atol=0, rtol=0)


def _all_layouts():
    results = {
        name: _run(family, degrees, options, packed=name.endswith("packed"))
        for name, (family, degrees, options) in LAYOUTS.items()
    }
    _meta_then_fsdp_then_init()
    return results, _rms_norm_on_sequence_shards()


@pytest.mark.distributed
def test_layouts_match_one_process():
    ranks = run_distributed(_all_layouts, 2, timeout=300)
    references = {}
    for name, (family, _, _) in LAYOUTS.items():
        packed = name.endswith("packed")
        if (family, packed) not in references:
            references[family, packed] = _run(family, packed=packed)
    for results, norm in ranks:
        for name, got in results.items():
            family = LAYOUTS[name][0]
            ref = references[family, name.endswith("packed")]
            torch.testing.assert_close(got["logits"], ref["logits"], atol=ATOL, rtol=0, msg=name)
            for key in ("loss", "norm"):
                torch.testing.assert_close(got[key], ref[key], atol=ATOL, rtol=0, msg=name)
            for key in ("grads", "params"):
                assert got[key].keys() == ref[key].keys(), name
                for param, value in ref[key].items():
                    torch.testing.assert_close(
                        got[key][param], value, atol=ATOL, rtol=0, msg=f"{name} {key} {param}"
                    )
        for key, (got, expected) in norm.items():
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=key)
    assert references["llama", False]["norm"] > 0.5  # so clipping really clips
    # packing changes the answer, so the packed layout really tests cu_seqlens under TP
    assert not torch.allclose(
        references["llama", True]["logits"], references["llama", False]["logits"]
    )


def test_unsupported_layouts_are_refused():
    spec = get_model_spec("llama")
    model = spec.build(build_model_config("llama", flavor="debug"))
    with pytest.raises(ParallelError, match="need tp > 1"):
        spec.parallelize(model, ParallelDims(world_size=1), sequence_parallel=True)


def test_the_tp_plan_needs_tp_to_divide_the_heads():
    with pytest.raises(ParallelError, match="tp=4 does not divide num_kv_heads=2"):
        llama_tp_plan(num_heads=8, num_kv_heads=2, tp=4)
    plan = llama_tp_plan(num_heads=4, num_kv_heads=2, tp=2, sequence_parallel=True)
    assert {"tok_embeddings", "norm", "layers.*.attention.wq", "layers.*.ffn_norm"} <= set(plan)


def test_selective_recompute_keeps_the_attention_output(monkeypatch):
    # Packed documents take mindspeed-ops' attention op: selective recompute must keep its
    # output (one kernel forward per block), full recompute runs it again in backward.
    from mindspeed_ops import attention_kernels

    calls = []
    forward = attention_kernels.forward

    def counted(*args, **kwargs):
        calls.append(args[0])
        return forward(*args, **kwargs)

    monkeypatch.setattr(attention_kernels, "forward", counted)
    spec = get_model_spec("llama")
    config = build_model_config("llama", flavor="debug")
    tokens = torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 12, 32], dtype=torch.int32)
    counts, losses = {}, {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = spec.parallelize(spec.build(config), ParallelDims().build(), ac_mode=mode)
        calls.clear()
        loss = model(tokens, cu_seqlens=cu).float().logsumexp(-1).mean()
        loss.backward()
        counts[mode], losses[mode] = len(calls), loss.detach()
    assert counts == {"none": config.num_layers, "selective": config.num_layers,
                      "full": 2 * config.num_layers}, counts  # fmt: skip
    torch.testing.assert_close(losses["selective"], losses["none"])
