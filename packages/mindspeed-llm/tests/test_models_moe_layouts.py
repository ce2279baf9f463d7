"""MoE models under tensor, context and pipeline parallel, and the all-gather token
dispatcher, give one process's loss, aux loss, router loads and gradients (fp32, gloo).

Each spawned function builds the one-process reference itself (same seed, same batch),
then the layout, and compares: the cross entropy, the aux loss (load balancing + z-loss),
the expert loads `LoadTracker` reports, and the gradients of every parameter (router,
experts, shared experts, attention, embeddings)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from mindspeed_core.errors import ConfigError
from mindspeed_core.parallel import (
    ParallelConfig,
    ParallelDims,
    build_pipeline_schedule,
    shard_sequence,
)
from mindspeed_core.testing import run_distributed
from mindspeed_llm.models import build_model_config, get_model_spec
from mindspeed_llm.models.common.layout import check_layout
from mindspeed_llm.models.common.moe_stats import LoadTracker, moe_aux_loss

TOL = {"rtol": 1e-4, "atol": 1e-5}
BATCH, SEQ = 4, 16
COEFS = {"router_aux_loss_coef": 0.01, "router_z_loss_coef": 1e-3}


def _tokens(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (BATCH, SEQ + 1), generator=gen)


def _build(family, **changes):
    spec = get_model_spec(family)
    if family in ("deepseek_v3", "glm4_moe"):
        changes.setdefault("num_nextn_predict_layers", 0)  # MTP is refused under tp/pp/cp
    torch.manual_seed(0)
    return spec, spec.build(build_model_config(family, flavor="debug", **COEFS, **changes))


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _grads(models):
    """Full gradients by name over a model or a list of pipeline stages."""
    models = models if isinstance(models, list) else [models]
    return {n: _full(p.grad) for m in models for n, p in m.named_parameters()}


def _reference(family, rows_per_loss, **changes):
    """Mean over groups of `rows_per_loss` rows of (cross entropy + aux loss): the loss,
    the mean aux, the router loads and the gradients of one process."""
    _, model = _build(family, **changes)
    tracker = LoadTracker(model)
    data = _tokens()
    ces, auxes = [], []
    for rows in data.split(rows_per_loss):
        logits = model(rows[:, :-1])
        ces.append(F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()))
        auxes.append(moe_aux_loss(model, model.config))
        tracker.observe(auxes[-1])
    ce, aux = torch.stack(ces).mean(), torch.stack(auxes).mean()
    (ce + aux).backward()
    return ce.detach(), aux.detach(), tracker.step()["moe_load"], _grads(model)


def _assert_grads(grads, ref, label):
    assert grads.keys() == ref.keys(), label
    for name, want in ref.items():
        got = grads[name][tuple(slice(0, s) for s in want.shape)]  # a padded vocabulary
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, n=name: f"{label} {n}: {m}")


def _assert_same(label, ref, ce, aux, loads, grads):
    ref_ce, ref_aux, ref_loads, ref_grads = ref
    torch.testing.assert_close(ce, ref_ce, **TOL, msg=lambda m: f"{label} loss: {m}")
    torch.testing.assert_close(aux, ref_aux, **TOL, msg=lambda m: f"{label} aux: {m}")
    torch.testing.assert_close(
        torch.tensor(loads), torch.tensor(ref_loads), msg=lambda m: f"{label} loads: {m}"
    )
    _assert_grads(grads, ref_grads, label)


# -- tensor parallel (+ sequence parallel, + expert parallel) ----------------------------


def _tensor_parallel_run(family, degrees, options, changes):
    """Each data-parallel rank takes its rows; tp peers read the same rows."""
    spec, model = _build(family, **changes)
    dims = ParallelDims(**degrees).build()
    model = spec.parallelize(model, dims, **options)
    tracker = LoadTracker(model)
    rows = _tokens().split(BATCH // dims.dp)[dims.rank("dp")]
    logits = model(rows[:, :-1])
    ce = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
    aux = moe_aux_loss(model, model.config)
    tracker.observe(aux)
    (ce + aux).backward()
    loss = torch.stack([ce, aux]).detach()
    if dims.dp > 1:
        dist.all_reduce(loss, group=dims.mesh("dp").get_group())
        loss /= dims.dp
    dp = dims.mesh("dp")
    loads = tracker.step(None if dp is None else dp.get_group())["moe_load"]
    return loss[0], loss[1], loads, _grads(model)


def _tp_cases(cases):
    for family, degrees, options, changes in cases:
        world_dp = degrees.get("dp_shard", 1)
        ref = _reference(family, BATCH // world_dp, **changes)
        got = _tensor_parallel_run(family, degrees, options, changes)
        _assert_same(f"{family} {degrees} {options}", ref, *got)


TP2_CASES = {
    "mixtral_sp": ("mixtral", {"tp": 2}, {"sequence_parallel": True}, {}),
    "mixtral": ("mixtral", {"tp": 2}, {}, {}),
    # a gated shared expert split over tp, and token dropping on the gathered sequence
    "qwen2_moe_sp": ("qwen2_moe", {"tp": 2}, {"sequence_parallel": True}, {"capacity_factor": 1.0}),
}


def test_tp2_with_sequence_parallel_matches_one_process():
    """Attention split over tp, routed experts whole on each rank, the sequence gathered
    around the MoE block."""
    run_distributed(_tp_cases, 2, [TP2_CASES["mixtral_sp"]], timeout=300)


@pytest.mark.slow
def test_tp2_without_sequence_parallel_and_with_a_shared_expert_matches_one_process():
    run_distributed(_tp_cases, 2, [TP2_CASES["mixtral"], TP2_CASES["qwen2_moe_sp"]], timeout=300)


@pytest.mark.slow
def test_tp2_by_ep2_matches_one_process():
    """4 ranks: dp_shard=2 x tp=2, experts over ep=2 (the dp_shard ranks of a tp rank)."""
    cases = [
        ("mixtral", {"tp": 2, "dp_shard": 2, "ep": 2}, {"sequence_parallel": True}, {}),
        ("qwen2_moe", {"tp": 2, "dp_shard": 2, "ep": 2}, {"ep_dispatcher": "allgather"}, {}),
        ("deepseek_v3", {"tp": 2, "dp_shard": 2, "ep": 2}, {"sequence_parallel": True}, {}),
    ]
    run_distributed(_tp_cases, 4, cases, timeout=600)


# -- expert parallel: the all-gather dispatcher equals the all-to-all one ----------------


def _dispatchers(families):
    for family in families:
        ref = _reference(family, BATCH // 2)
        degrees = {"dp_shard": 2, "ep": 2}
        alltoall = _tensor_parallel_run(family, degrees, {}, {})
        allgather = _tensor_parallel_run(family, degrees, {"ep_dispatcher": "allgather"}, {})
        _assert_same(f"{family} alltoall", ref, *alltoall)
        _assert_same(f"{family} allgather", ref, *allgather)
        torch.testing.assert_close(allgather[3], alltoall[3], **TOL)


def test_allgather_dispatcher_equals_alltoall_at_ep2():
    """DeepSeek-V3: group-limited sigmoid routing, shared experts, a dense first block."""
    run_distributed(_dispatchers, 2, ["deepseek_v3"], timeout=300)


@pytest.mark.slow
def test_allgather_dispatcher_equals_alltoall_at_ep2_mixtral():
    run_distributed(_dispatchers, 2, ["mixtral"], timeout=300)


# -- context parallel ---------------------------------------------------------------------


def _cp_run(family, degrees):
    """Ring attention at cp=2: each rank routes its zig-zag half of every sequence."""
    ref = _reference(family, BATCH)
    spec, model = _build(family)
    dims = ParallelDims(**degrees).build()
    cp_group = dims.mesh("cp").get_group()
    model = spec.parallelize(model, dims, cp_mode="ring")
    tracker = LoadTracker(model)
    data = _tokens()
    tokens, labels = data[:, :-1], data[:, 1:]
    positions = torch.arange(SEQ).expand_as(tokens)
    local = [shard_sequence(t, dims.rank("cp"), 2) for t in (tokens, labels, positions)]
    logits = model(local[0], position_ids=local[2])
    ce_sum = F.cross_entropy(logits.flatten(0, 1), local[1].flatten(), reduction="sum")
    aux = moe_aux_loss(model, model.config)
    tracker.observe(aux)
    # FSDP averages over the cp ranks: each backpropagates cp x its share of the mean
    (ce_sum / labels.numel() * 2 + aux).backward()
    loss = torch.stack([ce_sum / labels.numel(), aux / 2]).detach()
    dist.all_reduce(loss, group=cp_group)
    loads = tracker.step(cp_group)["moe_load"]
    _assert_same(f"{family} {degrees}", ref, loss[0], loss[1], loads, _grads(model))


def test_cp2_ring_matches_one_process():
    run_distributed(_cp_run, 2, "mixtral", {"cp": 2}, timeout=300)


def _latent_layouts():
    """DeepSeek-V3 and V2 (multi-head latent attention, MoE with shared experts; V3 with
    low-rank queries and sigmoid group routing, V2's debug softmax routing): tp=2 with
    sequence parallel (heads split, low-rank parts replicated), then cp=2 ring."""
    for family in ("deepseek_v3", "deepseek_v2"):
        _tp_cases([(family, {"tp": 2}, {"sequence_parallel": True}, {})])
        _cp_run(family, {"cp": 2})


def test_latent_attention_tp2_and_cp2_match_one_process():
    run_distributed(_latent_layouts, 2, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "degrees"),
    [(2, {"cp": 2, "ep": 2}), (4, {"cp": 2, "tp": 2})],
    ids=["cp2_ep2", "cp2_tp2"],
)
def test_cp2_with_ep_or_tp_matches_one_process(world, degrees):
    """Experts spread over the cp ranks (ep is carved from dp_shard x cp), or tp inside cp."""
    run_distributed(_cp_run, world, "mixtral", degrees, timeout=600)


def _family_layouts(family, tp):
    """A family's layouts in one spawn: tp=2 with sequence parallel (if `tp`), ep=2 over
    dp_shard=2 (the all-to-all dispatcher), then cp=2 ring."""
    if tp:
        _tp_cases([(family, {"tp": 2}, {"sequence_parallel": True}, {})])
    _tp_cases([(family, {"dp_shard": 2, "ep": 2}, {}, {})])
    _cp_run(family, {"cp": 2})


def test_glm4_moe_tp2_ep2_and_cp2_match_one_process():
    """GLM-4.5: per-head qk-norm and q/k/v biases split over tp, grouped sigmoid routing
    with shared experts and a dense first block, partial RoPE under ring attention."""
    run_distributed(_family_layouts, 2, "glm4_moe", True, timeout=300)


def test_minimax_m2_tp2_ep2_and_cp2_match_one_process():
    """MiniMax-M2: the q/k norm over all heads split over tp (squares summed across the
    ranks), sigmoid routing with the balancing bias in every block over ep=2, the norm
    under ring cp=2."""
    run_distributed(_family_layouts, 2, "minimax_m2", True, timeout=300)


# -- pipeline parallel ----------------------------------------------------------------------


def _pp_run(family, changes, options, degrees):
    """pp=2, 1F1B over 2 microbatches: aux losses of both stages' blocks reach the
    gradients through `AttachAux`; the tracker sums the loads over the stages."""
    ref = _reference(family, BATCH // 2, **changes)
    spec, model = _build(family, **changes)
    dims = ParallelDims(**degrees).build()
    parts = spec.pipeline(model, dims, device="cpu", schedule="1F1B", **options)
    tracker = LoadTracker(parts.model_parts, pp_group=dims.mesh("pp").get_group(),
                          num_experts=model.config.num_experts)  # fmt: skip
    for block in (m for p in parts.model_parts for m in p.modules()):
        if hasattr(block, "aux_grad_scale"):
            block.aux_grad_scale = 0.5  # each microbatch's share of the step
    data = _tokens()
    losses = []

    def loss_fn(logits, labels):
        losses.append(F.cross_entropy(logits.flatten(0, 1), labels.flatten()).detach())
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()) / 2

    schedule = build_pipeline_schedule(parts.stages, 2, loss_fn, "1F1B", scale_grads=False)
    schedule.step(data[:, :-1], target=data[:, 1:])
    top_k, num_experts = model.config.num_experts_per_tok, model.config.num_experts
    for block in tracker.layers.values():  # 2 forwards of 2 x SEQ tokens, none doubled
        assert block.step_stats[:num_experts].sum() == BATCH * SEQ * top_k
        assert block.step_stats[num_experts + 1] == 2
    metrics = tracker.step()
    # torch calls loss_fn once more before the schedule to infer gradient shapes
    ce = torch.stack(losses[-2:]).mean() if losses else torch.zeros(())
    dist.all_reduce(ce, group=dims.mesh("pp").get_group())  # only the last stage computed it
    grads = _grads(parts.model_parts)
    ref_grads = {n: g for n, g in ref[3].items() if n in grads}
    ref = (*ref[:3], ref_grads)
    _assert_same(f"{family} {degrees} {options}", ref, ce, torch.tensor(metrics["moe_aux_loss"]),
                 metrics["moe_load"], grads)  # fmt: skip
    return sorted(grads)


def _pp_cases(cases):
    return [_pp_run(*case) for case in cases]


PER_LAYER, PP2 = {"router_aux_loss_scope": "layer"}, {"pp": 2}
PP2_CASES = {
    "mixtral": ("mixtral", PER_LAYER, {}, PP2),
    # a dense first block, shared experts, group-limited routing; 3 blocks split 2 + 1
    "deepseek_v3": ("deepseek_v3", PER_LAYER, {}, PP2),
    # recompute re-runs each block's forward in backward: counted once
    "mixtral_recompute": ("mixtral", PER_LAYER, {"ac_mode": "full"}, PP2),
    "mixtral_tp2": ("mixtral", PER_LAYER, {}, {"pp": 2, "tp": 2}),
    "glm4_moe": ("glm4_moe", PER_LAYER, {}, PP2),
    "minimax_m2": ("minimax_m2", PER_LAYER, {}, PP2),
}


@pytest.mark.parametrize(
    "case",
    [
        "mixtral",
        pytest.param("deepseek_v3", marks=pytest.mark.slow),
        pytest.param("mixtral_recompute", marks=pytest.mark.slow),
        pytest.param("mixtral_tp2", marks=pytest.mark.slow),
        pytest.param("glm4_moe", marks=pytest.mark.slow),
        pytest.param("minimax_m2", marks=pytest.mark.slow),
    ],
)
def test_pp2_matches_one_process(case):
    world = 4 if "tp" in PP2_CASES[case][3] else 2
    results = run_distributed(_pp_cases, world, [PP2_CASES[case]], timeout=600)
    # the two stages hold every parameter once, and both hold a router
    first, last = results[0][0], results[-1][0]
    assert not set(first) & set(last)
    assert all(any("router" in n for n in r[0]) for r in results)


# -- refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "changes", "parallel", "message"),
    [
        ("mixtral", {}, {"pp": 2}, "router_aux_loss_scope=layer"),
        ("qwen2_moe", {"capacity_factor": 1.0}, {"cp": 2}, "capacity_factor=1.0 drops tokens"),
        ("deepseek_v3", {"num_nextn_predict_layers": 0}, {"tp": 3}, "multi-head latent attention"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 33}, {"tp": 2}, "shared_expert_inter"),
    ],
)
def test_moe_layouts_we_cannot_build_are_refused(family, changes, parallel, message):
    config = build_model_config(family, flavor="debug", **changes)
    with pytest.raises(ConfigError, match=message):
        check_layout(config, ParallelConfig(**parallel))
    assert not dist.is_initialized()


def test_moe_layouts_now_accepted():
    for family, changes, parallel in [
        ("mixtral", {}, {"tp": 2, "sequence_parallel": True}),
        ("mixtral", {}, {"cp": 2}),
        ("mixtral", {"router_aux_loss_scope": "layer"}, {"pp": 2}),
        ("qwen3_moe", {}, {"tp": 2, "ep": 2, "dp_shard": 2}),
        ("deepseek_v3", {"num_nextn_predict_layers": 0}, {"pp": 3}),
    ]:
        config = build_model_config(family, flavor="debug", **changes)
        assert check_layout(config, ParallelConfig(**parallel)) == (
            None if parallel.get("pp", 1) == 1 else [1] * parallel["pp"]
        )
