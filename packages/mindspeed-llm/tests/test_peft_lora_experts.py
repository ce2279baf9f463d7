"""LoRA on routed experts (one A/B per expert, through the grouped matmul): logits and A/B
gradients equal a per-expert loop written here (softmax Qwen3-MoE, sigmoid DeepSeek-V3 with
its shared expert) and peft's own `ParamWrapper` on transformers' Qwen3-MoE (fp32, 1e-5);
merging folds to the same logits; ep=2 (x dp_shard=2) and tp=2 equal one process, ep
sharding A/B like the base; a LoRA SFT run on a Qwen3-MoE folder trains, saves the expert
adapters, loads back (unmerged = merged) and exports to peft (expert adapters fused into
`target_parameters` of transformers' 3-D experts), which `PeftModel` loads with our logits;
unknown or unmatched targets and QLoRA on experts are refused in one line."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from mindspeed_core.errors import CheckpointError, ConfigError
from mindspeed_core.parallel import ParallelConfig
from mindspeed_core.testing import import_sibling, run_distributed
from mindspeed_llm.models import build_model_config, get_model_spec
from mindspeed_llm.models.common.moe import MoE
from mindspeed_llm.peft import LoRAConfig, adapters_disabled, apply_lora, lora_transform, merge_lora
from mindspeed_llm.peft.experts import expert_adapters
from mindspeed_llm.peft.names import to_peft_names
from mindspeed_llm.train.build import build_model
from mindspeed_ops import swiglu

EXPERTS_ONLY = ["gate_proj", "up_proj", "down_proj"]
SEQ = 16


def _model(family, **changes):
    config = build_model_config(family, flavor="debug", ops_impl="reference", **changes)
    torch.manual_seed(0)
    model = get_model_spec(family).build(config)
    model.init_weights()
    return model.train()


def _randomise(model, seed=5):
    """Draw every B (0 at init, which would make A's gradient 0), whole, keep this rank's share."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".lora_B" in name:
                full = torch.randn(p.shape, generator=gen) * 0.05
                if isinstance(p, DTensor):
                    full = distribute_tensor(full, p.device_mesh, p.placements)
                p.copy_(full)


def _loss(logits, x):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())


def _x(vocab, batch=2, seq=SEQ):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


# -- the per-expert loop the grouped path must equal ---------------------------------------
def _expert_weight(experts, proj, e):
    """Expert e's (out, in) weight with its adapter folded: W_e + s B_e A_e."""
    weight = getattr(experts, proj)[e].t()
    if proj not in experts.adapters or experts.adapters[proj].lora_disabled:
        return weight
    adapter = experts.adapters[proj]
    return weight + adapter.lora_scaling * adapter.lora_B[e] @ adapter.lora_A[e]


def _loop_moe(moe: MoE, x):
    """The MoE block written as a loop over experts: each expert's routed tokens through
    x_e @ (W_e + s B_e A_e)^T, weighted and summed (the shared expert added as the block does)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    indices, weights, _, _ = moe.router(x)
    out = torch.zeros_like(x)
    for e in range(moe.num_experts):
        token, slot = torch.nonzero(indices == e, as_tuple=True)
        xe = x[token]
        gate = xe @ _expert_weight(moe.experts, "w1", e).t()
        up = xe @ _expert_weight(moe.experts, "w3", e).t()
        y = swiglu(gate, up, impl="reference") @ _expert_weight(moe.experts, "w2", e).t()
        out = out.index_add(0, token, y * weights[token, slot, None])
    if moe.shared_expert_gate is not None:
        out = out + torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    elif moe.shared_expert is not None:
        out = out + moe.shared_expert(x)
    return out.view(shape)


def _logits_and_grads(model, x, loop: bool):
    handles = []
    if loop:  # every MoE block's output replaced by the loop's, from the same input
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            handles.append(moe.register_forward_hook(lambda m, args, out: _loop_moe(m, args[0])))
    model.zero_grad()
    logits = model(x)
    _loss(logits, x).backward()
    for h in handles:
        h.remove()
    # (DeepSeek-V3's multi-token-prediction module is not in the logits' graph)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize(("family", "targets"), [
    ("qwen3_moe", EXPERTS_ONLY),  # softmax routing, no shared expert
    ("deepseek_v3", ["linear_fc1", "linear_fc2", "wo"]),  # sigmoid, groups, shared expert, MTP
])  # fmt: skip
def test_expert_lora_equals_a_per_expert_loop(family, targets):
    model = _model(family)
    lora = LoRAConfig(rank=4, alpha=8, rslora=family == "deepseek_v3", targets=targets)
    names = apply_lora(model, lora)
    experts = [n for n, _ in expert_adapters(model)]
    assert experts and set(experts) <= set(names)
    assert {n.rsplit(".", 1)[1] for n in experts} == {"w1", "w3", "w2"}
    _randomise(model)
    adapter = dict(expert_adapters(model))[experts[0]]
    num_experts = model.config.num_experts
    assert adapter.lora_A.shape[:2] == (num_experts, 4) and adapter.lora_B.shape[0] == num_experts
    assert adapter.lora_scaling == (8 / 2 if lora.rslora else 8 / 4)
    # the router and the base stay frozen; only adapters train
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    x = _x(model.config.vocab_size)
    ours, grads = _logits_and_grads(model, x, loop=False)
    want, want_grads = _logits_and_grads(model, x, loop=True)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    expert_grads = [g for n, g in grads.items() if ".experts.adapters." in n]
    assert expert_grads and all(g.abs().sum() > 0 for g in expert_grads)
    with torch.no_grad(), adapters_disabled(model):  # the base alone differs
        assert (model(x) - ours).abs().max() > 1e-4


def test_merge_folds_each_expert_and_a_state_dict_round_trip_restores_the_adapters():
    model = _model("qwen3_moe")
    apply_lora(model, LoRAConfig(rank=4, alpha=8, targets=EXPERTS_ONLY))
    _randomise(model)
    adapters = {k: v.clone() for k, v in model.state_dict().items() if ".lora_" in k}
    assert len(adapters) == 2 * 3 * 2  # layers x (w1 w3 w2) x (A, B)
    x = _x(model.config.vocab_size)
    with torch.no_grad():
        want = model(x)
    base = {k: v.clone() for k, v in model.state_dict().items() if ".lora_" not in k}

    fresh = _model("qwen3_moe")
    apply_lora(fresh, LoRAConfig(rank=4, alpha=8, targets=EXPERTS_ONLY))
    fresh.load_state_dict({**base, **adapters})
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), want, atol=1e-6, rtol=1e-6)
        merge_lora(fresh)
        assert not list(expert_adapters(fresh))
        assert set(fresh.state_dict()) == set(base)
        torch.testing.assert_close(fresh(x), want, atol=1e-5, rtol=1e-5)
        w = "layers.0.feed_forward.experts.w2"
        w2 = "layers.0.feed_forward.experts.adapters.w2."
        a, b = adapters[w2 + "lora_A"], adapters[w2 + "lora_B"]
        torch.testing.assert_close(fresh.state_dict()[w][3], base[w][3] + 2.0 * (b[3] @ a[3]).t())


# -- peft's ParamWrapper (target_parameters) on transformers' Qwen3-MoE ----------------------
def test_expert_lora_equals_peft_param_wrapper_on_transformers_qwen3_moe():
    peft = pytest.importorskip("peft")
    moe_tests = import_sibling(__file__, "test_models_moe")
    hf = moe_tests.make_hf("qwen3_moe").train()
    ours = moe_tests.ours_from(hf).train()
    apply_lora(ours, LoRAConfig(rank=4, alpha=8, targets=EXPERTS_ONLY))
    fused = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # transformers 5's 3-D experts
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=fused)
    theirs = peft.get_peft_model(hf, config).train()
    wrappers = {}
    for name, module in theirs.named_modules():
        if isinstance(module, peft.tuners.lora.layer.ParamWrapper):
            layer = int(name.split(".layers.")[1].split(".")[0])
            wrappers[(layer, module.parameter_name)] = module
    assert len(wrappers) == 2 * 2
    mine = dict(expert_adapters(ours))
    num_experts, inter, gen = 4, 32, torch.Generator().manual_seed(3)
    with torch.no_grad():
        for (layer, param), wrapper in wrappers.items():
            a, b = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
            b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
            per_a = a.view(num_experts, 4, -1)  # (E, r, in): peft's A rows are expert-major
            per_b = b.view(b.shape[0], 4, num_experts).permute(2, 0, 1)  # (E, out, r)
            prefix = f"layers.{layer}.feed_forward.experts."
            if param == "down_proj":
                mine[prefix + "w2"].lora_A.copy_(per_a)
                mine[prefix + "w2"].lora_B.copy_(per_b)
            else:  # one A for the fused gate/up: ours gets it twice, B split by rows
                for proj, rows in (("w1", slice(0, inter)), ("w3", slice(inter, 2 * inter))):
                    mine[prefix + proj].lora_A.copy_(per_a)
                    mine[prefix + proj].lora_B.copy_(per_b[:, rows])
    x = _x(512, seq=24)
    logits, peft_logits = ours(x), theirs(input_ids=x).logits
    torch.testing.assert_close(logits, peft_logits, atol=1e-5, rtol=1e-5)
    _loss(logits, x).backward()
    _loss(peft_logits, x).backward()
    for (layer, param), wrapper in wrappers.items():
        a_grad = wrapper.lora_A["default"].weight.grad.view(num_experts, 4, -1)
        b_grad = wrapper.lora_B["default"].weight.grad
        b_grad = b_grad.view(b_grad.shape[0], 4, num_experts).permute(2, 0, 1)
        prefix = f"layers.{layer}.feed_forward.experts."
        if param == "down_proj":
            w2 = mine[prefix + "w2"]
            pairs = [(w2.lora_A.grad, a_grad), (w2.lora_B.grad, b_grad)]
        else:  # the shared A's gradient is the sum of ours
            w1, w3 = mine[prefix + "w1"], mine[prefix + "w3"]
            pairs = [(w1.lora_A.grad + w3.lora_A.grad, a_grad),
                     (torch.cat([w1.lora_B.grad, w3.lora_B.grad], dim=1), b_grad)]  # fmt: skip
        for got, want in pairs:
            assert want.abs().sum() > 0
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=f"{layer} {param}")


@pytest.mark.parametrize(("targets", "rslora"), [(["gate_proj", "down_proj"], True),
                                                 (["up_proj"], False)])  # fmt: skip
def test_the_peft_format_of_expert_adapters_gives_peft_our_logits(targets, rslora):
    """gate or up alone (the other's half of the fused adapter zero), rslora's alpha kept."""
    peft = pytest.importorskip("peft")
    from mindspeed_llm.peft.names import PEFT_PREFIX
    from mindspeed_llm.peft.peft_experts import peft_expert_adapters

    moe_tests = import_sibling(__file__, "test_models_moe")
    hf = moe_tests.make_hf("qwen3_moe")
    ours = moe_tests.ours_from(hf)
    apply_lora(ours, LoRAConfig(rank=4, alpha=8, rslora=rslora, targets=targets))
    _randomise(ours)
    tensors = {k: v for k, v in ours.state_dict().items() if ".lora_" in k}
    state, entries = peft_expert_adapters(tensors, rank=4, alpha=8, rslora=rslora,
                                          prefix=PEFT_PREFIX)  # fmt: skip
    config = peft.LoraConfig(r=4, lora_alpha=8, use_rslora=rslora, target_modules=[], **entries)
    theirs = peft.get_peft_model(hf, config).eval()
    loaded = peft.set_peft_model_state_dict(theirs, state)
    assert not loaded.unexpected_keys
    x = _x(512, seq=24)
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=x).logits, ours(x), atol=1e-5, rtol=1e-5)
        with adapters_disabled(ours):
            assert (ours(x) - theirs(input_ids=x).logits).abs().max() > 1e-4


# -- expert parallel ----------------------------------------------------------------------
def _ep_layouts():
    config = build_model_config("qwen2_moe", flavor="debug", ops_impl="reference")
    x = _x(config.vocab_size)
    lora = LoRAConfig(rank=4, alpha=8, targets=["q_proj", "linear_fc1", "linear_fc2"])
    after_tp = lora_transform(lora)
    out = {}
    layouts = {
        "one": (ParallelConfig(), 1),
        "ep2": (ParallelConfig(dp_shard=2, ep=2), None),
        "tp2": (ParallelConfig(tp=2, loss_parallel=False), None),  # experts whole on each rank
    }
    for name, (parallel, world) in layouts.items():
        dims = parallel.dims(world).build("cpu")
        model = build_model(config, dims, torch.device("cpu"), parallel=parallel, seq_len=SEQ,
                            after_tp=after_tp).model  # fmt: skip
        _randomise(model)  # values once materialised (hooks run on the meta device)
        params = {k: p for k, p in model.named_parameters() if p.requires_grad}
        placements = {k: tuple(p.placements) for k, p in params.items() if isinstance(p, DTensor)}
        # SGD: AdamW's first step is each gradient's sign, so a gradient within rounding of 0
        # (tp sums in another order) would flip a whole lr-sized update
        opt = torch.optim.SGD(params.values(), lr=1.0)
        logits = model(x)
        loss = _loss(logits, x)
        loss.backward()
        grads = {k: _full(p.grad) for k, p in params.items()}
        opt.step()
        with torch.no_grad():
            after = _full(model(x))
        out[name] = (loss.detach(), grads, after, placements)
    return out


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.mark.distributed
def test_expert_lora_under_ep2_and_tp2_equals_one_process_and_shards_like_the_base():
    results = run_distributed(_ep_layouts, 2, timeout=600)
    for result, layout in ((r, layout) for r in results for layout in ("ep2", "tp2")):
        want_loss, want_grads, want_after, _ = result["one"]
        loss, grads, after, placements = result[layout]
        torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=1e-5)
        assert grads.keys() == want_grads.keys()
        experts = [k for k in grads if ".experts.adapters." in k]
        assert len(experts) == 2 * 3 * 2  # layers x (w1 w3 w2) x (A, B)
        assert any(".shared_expert.w1.lora_A" in k for k in grads)  # the shared expert too
        for k, g in grads.items():
            torch.testing.assert_close(g, want_grads[k], atol=1e-5, rtol=1e-4, msg=f"{layout} {k}")
        torch.testing.assert_close(after, want_after, atol=1e-5, rtol=1e-5, msg=layout)
        if layout == "ep2":  # each rank holds its experts' A/B, as the base weights
            assert all(Shard(0) in placements[k] for k in experts)


# -- refusals -----------------------------------------------------------------------------
def test_unknown_unmatched_qlora_and_peft_export_of_expert_targets_are_one_line():
    with pytest.raises(ConfigError, match=r"unknown layer 'linear_fc3'"):
        LoRAConfig(rank=4, targets=["linear_fc1", "linear_fc3"])
    deepseek = _model("deepseek_v3")  # MLA: no k_proj
    with pytest.raises(ConfigError, match=r"'k_proj' matches no linear layer .* w1 w2 w3"):
        apply_lora(deepseek, LoRAConfig(rank=4, targets=["down_proj", "k_proj"]))
    assert not list(expert_adapters(deepseek))  # nothing was changed
    qwen = _model("qwen3_moe")
    with pytest.raises(ConfigError, match=r"QLoRA on routed experts is not built") as err:
        apply_lora(qwen, LoRAConfig(rank=4, quantize="nf4", targets=["q_proj", "up_proj"]))
    assert "\n" not in str(err.value)
    apply_lora(qwen, LoRAConfig(rank=4, targets=["q_proj", "up_proj"]))
    assert not qwen.layers["0"].feed_forward.router.weight.requires_grad
    assert set(qwen.layers["0"].feed_forward.experts.adapters) == {"w3"}
    keys = [n for n, _ in qwen.named_parameters() if ".lora_" in n]
    refused = r"experts.adapters.w3.lora_A: an expert adapter has no peft name of its own"
    with pytest.raises(CheckpointError, match=refused):
        to_peft_names(keys, qwen.config)


# -- `mindspeed sft` with LoRA on a MoE folder ----------------------------------------------
def test_a_lora_sft_run_on_a_moe_model_trains_and_its_checkpoint_loads_back(tmp_path, monkeypatch):
    from mindspeed_core.config import load_config
    from mindspeed_core.training import read_metrics
    from mindspeed_llm.loading import load_model, resolve_model_source
    from mindspeed_llm.models.checkpoint_io import tensor_metadata
    from mindspeed_llm.peft.checkpoint import load_adapter_weights, run_lora, write_peft_adapter
    from mindspeed_llm.sft import sft
    from mindspeed_llm.train.sft_config import SFTConfig

    sft_tests = import_sibling(__file__, "test_sft_train")
    moe_tests = import_sibling(__file__, "test_models_moe")
    monkeypatch.setenv("MINDSPEED_CACHE", str(tmp_path / "cache"))
    folder, data = sft_tests.make_run_inputs(tmp_path, n=16)
    moe_tests.make_hf("qwen3_moe").save_pretrained(folder)  # over the Llama the helper writes
    run = tmp_path / "run"
    args = sft_tests.run_args(folder, data, run, "--data.mode=pack", "--train.steps=6",
                              "--train.micro_batch=4", "--train.global_batch=4",
                              "--optim.lr=2e-2", "--lora.rank=4", "--lora.alpha=8",
                              "--lora.targets=[q_proj,linear_fc1,linear_fc2]")  # fmt: skip
    sft(load_config(SFTConfig, None, args))
    losses = [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert losses[-1] < losses[0]
    saved = tensor_metadata(run / "checkpoints" / "step_6")
    assert all(".lora_" in name for name in saved)  # the frozen base (experts too) is not saved
    assert len([n for n in saved if ".experts.adapters." in n]) == 2 * 3 * 2

    merged, config = load_model(run / "checkpoints", ops_impl="reference")
    assert not list(expert_adapters(merged))  # folded into the stacked expert weights
    source = resolve_model_source(run / "checkpoints", ops_impl="reference")
    lora = run_lora(source.path)
    plain = get_model_spec(config.family).build(config)
    load_adapter_weights(plain, source.path, source.weights, config, lora)
    trained = dict(expert_adapters(plain))["layers.1.feed_forward.experts.w2"]
    assert trained.lora_B.abs().max() > 0  # the experts' adapters trained
    base, _ = load_model(folder, ops_impl="reference")
    x = _x(config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(merged(x), plain.eval()(x), atol=1e-5, rtol=1e-5)
        assert (merged(x) - base(x)).abs().max() > 1e-3
    # the peft export: expert adapters as target_parameters of the fused v5 experts
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "adapter"
    out.mkdir()
    write_peft_adapter(source.path, source.weights, config, lora, out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(hf, out).eval()(input_ids=x).logits
        torch.testing.assert_close(adapted, merged(x), atol=1e-5, rtol=1e-5)
