"""Multi-token prediction under tensor, context and pipeline parallel gives one process's
next-token loss, MTP loss and gradients (fp32, gloo, 1e-5): DeepSeek-V3's and GLM-4.5's
debug models (latent or grouped-query attention, MoE and dense blocks, one MTP module) at
tp=2 (with and without sequence and loss parallel), cp=2 (ring and Ulysses, packed
documents and whole rows, where the token k ahead sits on the other rank), pp=2 (the MTP
module on the last stage), tp=2 x cp=2 and tp=2 x pp=2; and the trainer's step at pp=2
and cp=2.

Each rank's next-token loss is its token sum / the whole count x cp, as in
test_models_cp: FSDP over cp averages gradients over the cp ranks; the MTP loss of a cp
rank is its share (`common.mtp`), whose mean over the cp ranks is one process's."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mindspeed_core.parallel import (
    ParallelConfig,
    ParallelDims,
    build_pipeline_schedule,
    gather_tokens,
    loss_parallel_context,
    packed_shard_index,
    shard_sequence,
)
from mindspeed_core.parallel.dtensor import full
from mindspeed_core.testing import run_distributed
from mindspeed_llm.models import build_model_config, get_model_spec
from mindspeed_llm.models.common.layout import LayoutError, check_layout
from mindspeed_ops import position_ids_from_cu_seqlens

TOL = {"rtol": 1e-5, "atol": 1e-5}
ROWS, SEQ = 2, 16
# documents over the 2 rows of 16: 5, 11, 14, 2 tokens (the last two cross the row end)
CU = torch.tensor([0, 5, 16, 30, 32], dtype=torch.int32)


def _batch():
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (ROWS, SEQ), generator=gen)
    labels = torch.randint(0, 512, (ROWS, SEQ), generator=gen)
    labels[0, 3] = labels[1, 7] = -100  # unsupervised positions, at every depth
    return tokens, labels


def _model(family, **changes):
    torch.manual_seed(0)
    spec = get_model_spec(family)
    config = build_model_config(family, flavor="debug", ops_impl="reference", **changes)
    assert config.num_nextn_predict_layers == 1
    return spec, spec.build(config)


def _reference(family, packed):
    """One process: next-token mean, MTP loss, and the gradients of their sum."""
    _, model = _model(family)
    tokens, labels = _batch()
    kwargs = {"cu_seqlens": CU} if packed else {}
    logits = model(tokens, mtp_labels=labels, **kwargs)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    mtp = model.last_mtp_loss
    (loss + mtp).backward()
    return loss.detach(), mtp.detach(), {n: p.grad for n, p in model.named_parameters()}


def _local_inputs(tokens, labels, cp_rank, cp, packed):
    """This rank's zig-zag share: per row, or per packed document (as the trainer's
    `shard_context_parallel`)."""
    if not packed:
        positions = torch.arange(SEQ).expand_as(tokens)
        local = (shard_sequence(t, cp_rank, cp) for t in (tokens, labels, positions))
        return (*local, None)
    index, local_cu = packed_shard_index(CU, cp_rank, cp)
    positions = position_ids_from_cu_seqlens(CU)
    local = [
        gather_tokens(t.flatten(), index, pad)[None]
        for t, pad in ((tokens, 0), (labels, -100), (positions, 0))
    ]
    return (*local, local_cu)


def _run(family, degrees, options, packed):
    spec, model = _model(family)
    dims = ParallelDims(**degrees).build()
    model = spec.parallelize(model, dims, **options)
    tokens, labels = _batch()
    tokens, labels, positions, cu = _local_inputs(tokens, labels, dims.rank("cp"), dims.cp, packed)
    count = (_batch()[1] != -100).sum()
    with loss_parallel_context(options.get("loss_parallel", False)):
        logits = model(tokens, position_ids=positions, cu_seqlens=cu, mtp_labels=labels)
        loss_sum = F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        loss = full(loss_sum) / count * dims.cp  # replicated under loss parallel: whole
        mtp = model.last_mtp_loss
        (loss + mtp).backward()
    reported = torch.stack([loss.detach(), mtp.detach()])
    dist.all_reduce(reported)
    grads = {n: full(p.grad).detach() for n, p in model.named_parameters()}
    return reported / dist.get_world_size(), grads


def _layouts(cases):
    return {name: _run(*case) for name, case in cases.items()}


CASES_2 = {
    "deepseek_tp2": ("deepseek_v3", {"tp": 2}, {}, False),
    "glm_cp2_ring_packed": ("glm4_moe", {"cp": 2}, {"cp_mode": "ring"}, True),
}
SLOW_2 = {
    "glm_tp2_loss_parallel": ("glm4_moe", {"tp": 2}, {"loss_parallel": True}, True),
    "deepseek_cp2_ring": ("deepseek_v3", {"cp": 2}, {"cp_mode": "ring"}, False),
    "deepseek_cp2_ring_packed": ("deepseek_v3", {"cp": 2}, {"cp_mode": "ring"}, True),
    "glm_cp2_ulysses": ("glm4_moe", {"cp": 2}, {"cp_mode": "ulysses"}, False),
    "deepseek_tp2_sp_packed": ("deepseek_v3", {"tp": 2}, {"sequence_parallel": True}, True),
    "glm_tp2_sp_loss_parallel": (
        "glm4_moe",
        {"tp": 2},
        {"sequence_parallel": True, "loss_parallel": True},
        False,
    ),
}
CASES_4 = {
    "deepseek_tp2_cp2_packed": ("deepseek_v3", {"tp": 2, "cp": 2}, {}, True),
    "glm_tp2_cp2_loss_parallel": ("glm4_moe", {"tp": 2, "cp": 2}, {"loss_parallel": True}, True),
    "deepseek_tp2_sp_cp2": ("deepseek_v3", {"tp": 2, "cp": 2}, {"sequence_parallel": True}, False),
}


def _check(ranks, cases):
    references = {}
    for results in ranks:
        for name, (reported, grads) in results.items():
            family, _, _, packed = cases[name]
            if (family, packed) not in references:
                references[family, packed] = _reference(family, packed)
            want_loss, want_mtp, want_grads = references[family, packed]
            torch.testing.assert_close(reported[0], want_loss, **TOL, msg=f"{name} loss")
            torch.testing.assert_close(reported[1], want_mtp, **TOL, msg=f"{name} mtp loss")
            assert grads.keys() == want_grads.keys()
            for param, value in want_grads.items():
                torch.testing.assert_close(grads[param], value, **TOL, msg=f"{name} {param}")
            mtp_grad = grads[next(p for p in grads if p.endswith("eh_proj.weight"))]
            assert mtp_grad.abs().sum() > 0, name


@pytest.mark.distributed
def test_mtp_under_tp2_and_cp2_matches_one_process():
    _check(run_distributed(_layouts, 2, CASES_2, timeout=300), CASES_2)


@pytest.mark.distributed
@pytest.mark.slow
def test_mtp_under_more_tp2_and_cp2_layouts_matches_one_process():
    _check(run_distributed(_layouts, 2, SLOW_2, timeout=600), SLOW_2)


@pytest.mark.distributed
@pytest.mark.slow
def test_mtp_under_tp2_times_cp2_matches_one_process():
    _check(run_distributed(_layouts, 4, CASES_4, timeout=600), CASES_4)


# -- pipeline parallel: the MTP modules on the last stage -----------------------------------

NO_AUX = {"router_aux_loss_coef": 0.0, "router_z_loss_coef": 0.0}  # pp: no pooled aux loss
ROW_CU = [torch.tensor([0, 5, 16], dtype=torch.int32), torch.tensor([0, 14, 16], dtype=torch.int32)]


def _microbatches(packed):
    """Each row a microbatch: (tokens, labels, kwargs)."""
    tokens, labels = _batch()
    return [
        (tokens[i : i + 1], labels[i : i + 1], {"cu_seqlens": ROW_CU[i]} if packed else {})
        for i in range(ROWS)
    ]


def _pp_reference(family, packed):
    """One process, gradient accumulation: mean over microbatches of CE mean + MTP."""
    _, model = _model(family, **NO_AUX)
    losses, mtps = [], []
    for tokens, labels, kwargs in _microbatches(packed):
        logits = model(tokens, mtp_labels=labels, **kwargs)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        ((loss + model.last_mtp_loss) / ROWS).backward()
        losses.append(loss.detach())
        mtps.append(model.last_mtp_loss.detach())
    grads = {n: p.grad for n, p in model.named_parameters()}
    return torch.stack([torch.stack(losses).mean(), torch.stack(mtps).mean()]), grads


def _run_pp(family, degrees, options, packed):
    spec, model = _model(family, **NO_AUX)
    dims = ParallelDims(**degrees).build()
    schedule_name = options.pop("schedule", "1F1B")
    pipe = spec.pipeline(model, dims, device="cpu", schedule=schedule_name, **options)
    last = [p for p in pipe.model_parts if p.mtp is not None]
    for part in last:  # the step's share of each microbatch, as TrainStep sets it
        part.mtp.aux_grad_scale = 1.0 / ROWS
    losses, mtps = [], []

    def loss_fn(logits, labels):
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        losses.append(full(loss).detach())
        mtps.append(last[0].last_mtp_loss.detach())
        return loss / ROWS

    schedule = build_pipeline_schedule(pipe.stages, ROWS, loss_fn, schedule_name, scale_grads=False)
    mbs = _microbatches(packed)
    with loss_parallel_context(options.get("loss_parallel", False)):
        schedule.step(
            arg_mbs=[(t,) for t, _, _ in mbs],
            kwarg_mbs=[{**kw, "mtp_labels": lab} for _, lab, kw in mbs],
            target_mbs=[lab for _, lab, _ in mbs],
        )
    reported = torch.zeros(2)
    if pipe.has_last:  # torch calls loss_fn once more to infer shapes: the last ROWS calls
        reported = torch.stack(
            [torch.stack(losses[-ROWS:]).mean(), torch.stack(mtps[-ROWS:]).mean()]
        )
    dist.all_reduce(reported, group=dims.mesh("pp").get_group())
    grads = {
        n: full(p.grad).detach() for part in pipe.model_parts for n, p in part.named_parameters()
    }
    return reported, grads, last[0].mtp is not None if last else False


def _pp_layouts(cases):
    return {name: _run_pp(*case) for name, case in cases.items()}


PP_2 = {"deepseek_pp2_packed": ("deepseek_v3", {"pp": 2}, {}, True)}
PP_SLOW_2 = {
    "glm_pp2": ("glm4_moe", {"pp": 2}, {}, False),
    "deepseek_pp2_gpipe_uneven": (
        "deepseek_v3",
        {"pp": 2},
        {"schedule": "GPipe", "layers_per_stage": [1, 2]},
        False,
    ),
}
PP_4 = {
    "deepseek_tp2_pp2_packed": ("deepseek_v3", {"tp": 2, "pp": 2}, {}, True),
    "deepseek_tp2_pp2_sp": ("deepseek_v3", {"tp": 2, "pp": 2}, {"sequence_parallel": True}, False),
    "glm_tp2_pp2_loss_parallel": ("glm4_moe", {"tp": 2, "pp": 2}, {"loss_parallel": True}, False),
}


def _check_pp(ranks, cases):
    references = {}
    for name, (family, _, _, packed) in cases.items():
        if (family, packed) not in references:
            references[family, packed] = _pp_reference(family, packed)
        want, want_grads = references[family, packed]
        covered, holders = set(), 0
        for results in ranks:
            reported, grads, holds_mtp = results[name]
            torch.testing.assert_close(reported, want, **TOL, msg=f"{name} losses")
            for param, value in grads.items():
                torch.testing.assert_close(value, want_grads[param], **TOL, msg=f"{name} {param}")
            covered |= grads.keys()
            holders += holds_mtp
        assert covered == want_grads.keys(), name  # the stages hold the whole model
        assert holders == len(ranks) // 2, name  # the MTP modules live on the last stage only


@pytest.mark.distributed
def test_mtp_under_pp2_matches_one_process():
    _check_pp(run_distributed(_pp_layouts, 2, PP_2, timeout=300), PP_2)


@pytest.mark.distributed
@pytest.mark.slow
def test_mtp_under_more_pp2_layouts_matches_one_process():
    _check_pp(run_distributed(_pp_layouts, 2, PP_SLOW_2, timeout=600), PP_SLOW_2)


@pytest.mark.distributed
@pytest.mark.slow
def test_mtp_under_tp2_times_pp2_matches_one_process():
    _check_pp(run_distributed(_pp_layouts, 4, PP_4, timeout=600), PP_4)


# -- the trainer's step under pp: the kwargs, the attached loss's share, the metric ------


def _step_grads(parallel, micro_batches, n_microbatches=None):
    """One TrainStep of DeepSeek-V3 debug with MTP: loss, MTP metric, gradients by name."""
    from mindspeed_core.optim import OptimConfig
    from mindspeed_llm.train.build import build_model, build_train_parts
    from mindspeed_llm.train.objectives import NextToken
    from mindspeed_llm.train.step import TrainStep

    config = build_model_config("deepseek_v3", "debug", ops_impl="reference", **NO_AUX)
    dims = parallel.dims(dist.get_world_size() if dist.is_initialized() else 1).build("cpu")
    built = build_model(config, dims, torch.device("cpu"), parallel=parallel, seq_len=SEQ)
    parts = build_train_parts(built, OptimConfig(lr=1e-3, warmup_steps=0), total_steps=2)
    step = TrainStep(parts, NextToken(), dims, clip_grad=0.0, n_microbatches=n_microbatches)
    result = step(micro_batches)
    grads = {n: full(p.grad) for part in built.parts for n, p in part.named_parameters()}
    return float(result.loss), result.metrics["mtp_loss"], grads


def _packed_step_batch():
    from mindspeed_llm.data.collate import lm_batch

    samples = torch.randint(8, 512, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(5))
    samples[0, 5] = samples[1, 9] = 7  # an EOD in each row
    return lm_batch(samples, 7)


def _steps():
    batch = _packed_step_batch()
    return {
        "pp2": _step_grads(ParallelConfig(pp=2), [batch], n_microbatches=ROWS),
        "cp2": _step_grads(ParallelConfig(cp=2), [batch]),
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_training_step_under_pp2_and_cp2_matches_one_process():
    """pp: TrainStep passes the labels to the last stage, which attaches each
    microbatch's share of the MTP loss, and the metric reaches the first stage's rank too;
    cp: the step's zig-zag shards of packed documents (`shard_context_parallel`) and the
    metric's mean over cp give one process's MTP loss."""
    from mindspeed_llm.data.collate import split_batch

    # one process: the pipeline's microbatches (the MTP loss is a mean per microbatch)
    by_layout = {
        "pp2": _step_grads(ParallelConfig(), split_batch(_packed_step_batch(), ROWS)),
        "cp2": _step_grads(ParallelConfig(), [_packed_step_batch()]),
    }
    ranks = run_distributed(_steps, 2, timeout=300)
    for layout, (want_loss, want_mtp, want_grads) in by_layout.items():
        covered = set()
        for results in ranks:
            loss, mtp, grads = results[layout]
            assert loss == pytest.approx(want_loss, abs=1e-5), layout
            assert mtp == pytest.approx(want_mtp, abs=1e-5) and mtp > 0, layout
            for name, value in grads.items():
                torch.testing.assert_close(value, want_grads[name], **TOL, msg=f"{layout} {name}")
            covered |= grads.keys()
        assert covered == want_grads.keys(), layout


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_mtp_models_take_every_model_parallel_layout(family):
    """No layout is refused for having MTP modules (cp x pp is refused for every model)."""
    config = build_model_config(family, flavor="debug")
    check_layout(config, ParallelConfig(tp=2, sequence_parallel=True, cp=2))
    assert check_layout(config, ParallelConfig(tp=2, pp=3)) == [1, 1, 1]
    with pytest.raises(LayoutError, match="parallel.cp=2 with parallel.pp=2 is not supported"):
        check_layout(config, ParallelConfig(cp=2, pp=2))
