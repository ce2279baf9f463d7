"""Every layout trains the toy model to the same numbers as one process (fp32, 3 AdamW steps).

Losses, clipped gradients after the first step, grad norms and the parameters after
the last step are compared with `atol=ATOL`. Several layouts share one spawn.
"""

import pytest
import torch

from mindspeed_core.errors import ParallelError
from mindspeed_core.parallel import apply_fsdp
from mindspeed_core.testing import import_sibling, run_distributed

loop = import_sibling(__file__, "train_loop")
pytestmark = pytest.mark.distributed

ATOL = 1e-5  # fp32; observed differences are ~1e-7

WORLD2 = {
    "tp2": {"tp": 2},
    "dp_shard2": {"dp_shard": 2},
    "dp_replicate2": {"dp_replicate": 2},
    "tp2_sp_loss_parallel": {"tp": 2, "sp": True, "loss_parallel": True},
    "dp_shard2_full_ac": {"dp_shard": 2, "ac": "full"},
    "dp_shard2_no_reshard": {"dp_shard": 2, "reshard_after_forward": False},
    "tp2_sp_selective_ac": {"tp": 2, "sp": True, "ac": "selective"},
}
WORLD4 = {
    "hsdp_2x2": {"dp_replicate": 2, "dp_shard": 2},
    "tp2_dp_shard2": {"tp": 2, "dp_shard": 2},
    "tp2_sp_loss_parallel_dp_shard2_selective_ac": {
        "tp": 2,
        "dp_shard": 2,
        "sp": True,
        "loss_parallel": True,
        "ac": "selective",
    },
}


@pytest.fixture(scope="module")
def reference():
    return loop.train({})


def _train_layouts(layouts):
    return {name: loop.train(layout) for name, layout in layouts.items()}


def _assert_same(name, got, ref):
    for key in ("losses", "norms"):
        torch.testing.assert_close(
            torch.stack(got[key]), torch.stack(ref[key]), atol=ATOL, rtol=0, msg=f"{name} {key}"
        )
    for key in ("grads", "params"):
        assert got[key].keys() == ref[key].keys(), name
        for param, value in ref[key].items():
            torch.testing.assert_close(
                got[key][param],
                value,
                atol=ATOL,
                rtol=0,
                msg=lambda m, p=param, k=key: f"{name} {k} {p}: {m}",
            )


@pytest.mark.parametrize(
    ("world_size", "layouts"), [(2, WORLD2), (4, WORLD4)], ids=["world2", "world4"]
)
def test_layouts_match_one_process(reference, world_size, layouts):
    results = run_distributed(_train_layouts, world_size, layouts, timeout=300)
    assert reference["losses"][0] > reference["losses"][-1]  # it trains at all
    assert reference["norms"][0] > 0.5  # so clipping to 0.5 really clips
    for rank_result in results:
        for name, got in rank_result.items():
            _assert_same(name, got, reference)


BF16_STEPS = 10
BF16_LOSS_RTOL = 5e-3  # bf16 compute, fp32 master weights and reduction; observed ~2e-4


def _train_bf16():
    return loop.train({"dp_shard": 2}, BF16_STEPS, param_dtype=torch.bfloat16)


@pytest.mark.distributed
def test_bf16_mixed_precision_tracks_fp32():
    fp32 = loop.train({}, BF16_STEPS)
    bf16 = run_distributed(_train_bf16, 2, timeout=300)[0]
    losses32, losses16 = torch.stack(fp32["losses"]), torch.stack(bf16["losses"])
    assert losses16[-1] < losses16[0] - 0.1  # it trains
    torch.testing.assert_close(losses16, losses32, rtol=BF16_LOSS_RTOL, atol=0)
    assert not torch.equal(losses16, losses32)  # and bf16 compute really happened
    # Master weights stay fp32 (FSDP casts only the gathered copies).
    assert all(p.dtype == torch.float32 for p in bf16["params"].values())


def test_cpu_offload_of_a_cpu_model_is_refused():
    with pytest.raises(ParallelError, match="this model is already on the CPU"):
        apply_fsdp(loop.toy.make_model(), None, cpu_offload=True)
