"""Pipeline layouts of the dense decoder train like one process (fp32, 4 layers, 3 AdamW
steps of 4 microbatches): losses, grad norms, clipped gradients and updated parameters,
for each schedule torch offers, uneven splits, packed documents, TP (with recompute),
FSDP and DDP inside the stages; and checkpoints move between pp=2 and pp=1 in both directions."""

import pytest
import torch

from mindspeed_core.errors import ParallelError
from mindspeed_core.parallel import ParallelDims
from mindspeed_core.testing import import_sibling, run_distributed

loop = import_sibling(__file__, "pipeline_loop")
RTOL, ATOL = 1e-4, 1e-6

WORLD2 = {
    "pp2_1f1b": {"pp": 2},
    "pp2_gpipe": {"pp": 2, "schedule": "GPipe"},
    "pp2_interleaved_1f1b_v2": {"pp": 2, "schedule": "Interleaved1F1B", "stages_per_rank": 2},
    "pp2_interleaved_zero_bubble_v2": {
        "pp": 2,
        "schedule": "InterleavedZeroBubble",
        "stages_per_rank": 2,
    },
    "pp2_zbv": {"pp": 2, "schedule": "ZBVZeroBubble", "stages_per_rank": 2},
    "pp2_dualpipev": {"pp": 2, "schedule": "DualPipeV", "stages_per_rank": 2},
    "pp2_uneven_3_1": {"pp": 2, "layers_per_stage": [3, 1]},
    "pp2_packed": {"pp": 2},
}
WORLD4 = {
    "pp2_dp_replicate2": {"pp": 2, "dp_replicate": 2, "dp_shard": 1},
    "tp2_pp2_sp_loss_parallel": {
        "pp": 2,
        "tp": 2,
        "sequence_parallel": True,
        "loss_parallel": True,
        "ac_mode": "full",
    },
    "pp2_dp_shard2_interleaved": {
        "pp": 2,
        "dp_shard": 2,
        "schedule": "Interleaved1F1B",
        "stages_per_rank": 2,
    },
}


def _close(got, want, msg):
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=msg)


def _assert_same(name, got, ref):
    for key in ("losses", "norms"):
        _close(torch.stack(got[key]), torch.stack(ref[key]), f"{name} {key}")
    for key in ("grads", "params"):
        for param, value in got[key].items():
            _close(value, ref[key][param], f"{name} {key} {param}")


def _assert_layouts(results, layouts, references):
    for name in layouts:
        ref = references[name.endswith("packed")]
        covered = set()
        for rank_result in results:
            _assert_same(name, rank_result[name], ref)
            covered |= rank_result[name]["params"].keys()
        assert covered == ref["params"].keys(), name  # the stages hold the whole model


def _world2(layouts, pp1_checkpoint, pp2_checkpoint):
    results = {n: loop.train(layout, packed=n.endswith("packed")) for n, layout in layouts.items()}
    results["resumed_from_pp1"] = loop.train({"pp": 2}, first_step=2, load=pp1_checkpoint)
    loop.train({"pp": 2}, 2, save=pp2_checkpoint)
    return results


@pytest.fixture(scope="module")
def references():
    return {packed: loop.train(None, packed=packed) for packed in (False, True)}


@pytest.mark.distributed
def test_pipeline_layouts_and_checkpoints_match_one_process(references, tmp_path):
    pp1, pp2 = str(tmp_path / "pp1"), str(tmp_path / "pp2")
    loop.train(None, 2, save=pp1)
    results = run_distributed(_world2, 2, WORLD2, pp1, pp2, timeout=600)
    ref = references[False]
    _assert_layouts(results, WORLD2, references)
    assert ref["norms"][0] > 0.5  # clipping to 0.5 really clips
    # packing changes the answer, so the packed layout really carries cu_seqlens to stage 2
    assert not torch.allclose(references[True]["losses"][0], ref["losses"][0])
    # a pp=1 checkpoint continued under pp=2, and a pp=2 checkpoint under pp=1
    for rank_result in results:
        got = rank_result["resumed_from_pp1"]
        _close(torch.stack(got["losses"]), torch.stack(ref["losses"][2:]), "pp1 -> pp2")
        for param, value in got["params"].items():
            _close(value, ref["params"][param], f"pp1 -> pp2 {param}")
    resumed = loop.train(None, first_step=2, load=pp2)
    _close(torch.stack(resumed["losses"]), torch.stack(ref["losses"][2:]), "pp2 -> pp1")
    for param, value in resumed["params"].items():
        _close(value, ref["params"][param], f"pp2 -> pp1 {param}")


def _world4(layouts):
    return {name: loop.train(layout) for name, layout in layouts.items()}


@pytest.mark.distributed
@pytest.mark.slow
def test_pipeline_with_tp_and_fsdp_matches_one_process(references):
    results = run_distributed(_world4, 4, WORLD4, timeout=600)
    _assert_layouts(results, WORLD4, references)


def test_whole_model_and_recompute_with_zero_bubble_are_refused():
    spec, model = loop.make_model()
    with pytest.raises(ParallelError, match="pipeline_decoder"):
        spec.parallelize(model, ParallelDims(pp=2, world_size=2))
    with pytest.raises(ParallelError, match="InterleavedZeroBubble computes weight gradients"):
        spec.pipeline(
            model,
            ParallelDims(pp=2, world_size=2),
            device="cpu",
            schedule="InterleavedZeroBubble",
            stages_per_rank=2,
            ac_mode="full",
        )
