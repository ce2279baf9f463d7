"""ParallelDims: validation, the named meshes, and tensor-parallel plan errors."""

import pytest
import torch.distributed as dist

from mindspeed_core.errors import ParallelError
from mindspeed_core.parallel import ParallelDims, apply_tp
from mindspeed_core.testing import import_sibling, run_distributed

toy = import_sibling(__file__, "toy")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"tp": 2, "dp_shard": 3, "world_size": 4},
            r"dp_shard\(3\) x cp\(1\) x tp\(2\) .* = 6, but the world size is 4",
        ),
        (
            {"tp": 3, "world_size": 4},
            r"cannot infer dp_shard: .* = 3 does not divide the world size 4",
        ),
        ({"tp": 0, "world_size": 4}, r"tp=0 must be a positive integer"),
        ({"pp": 1.5, "world_size": 4}, r"pp=1.5 must be a positive integer"),
        ({"dp_shard": -2, "world_size": 4}, r"dp_shard=-2 must be a positive integer"),
        ({"ep": 4, "dp_shard": 2, "tp": 2, "world_size": 4}, r"ep=4 must divide dp_shard x cp = 2"),
    ],
)
def test_impossible_layouts_are_refused(kwargs, message):
    with pytest.raises(ParallelError, match=message):
        ParallelDims(**kwargs)


def test_dp_shard_is_inferred_and_one_process_needs_no_mesh():
    assert ParallelDims(tp=2, pp=2, world_size=16).dp_shard == 4
    dims = ParallelDims().build()  # no process group at all
    assert dims.world_size == 1 and dims.world_mesh is None
    assert dims.mesh("tp") is None and dims.rank("dp") == 0 and dims.degree("loss") == 1
    with pytest.raises(ParallelError, match="unknown mesh axis 'dpp'"):
        dims.mesh("dpp")


def test_a_multi_process_layout_needs_a_process_group():
    with pytest.raises(ParallelError, match="needs a process group"):
        ParallelDims(tp=2, world_size=2).build()


def _groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _describe(dims: ParallelDims) -> dict:
    out = {}
    for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "loss", "ep"):
        mesh = dims.mesh(name)
        out[name] = None if mesh is None else sorted(mesh.mesh.flatten().tolist())
    fsdp = dims.mesh("fsdp")
    out["fsdp"] = None if fsdp is None else (fsdp.mesh_dim_names, fsdp.mesh.tolist())
    return out


def _layouts_on_four_ranks():
    out = {}
    for name, kwargs in {
        "tp2_dp_shard2": {"tp": 2},
        "hsdp": {"dp_replicate": 2, "dp_shard": 2},
        "cp2_dp_shard2": {"cp": 2},
        "pp2_tp2": {"pp": 2, "tp": 2},
        "pp2_dp_shard2": {"pp": 2},
        "ep2": {"ep": 2},
    }.items():
        before = _groups()
        dims = ParallelDims(**kwargs).build()
        out[name] = _describe(dims)
        out[name]["new_groups"] = _groups() - before
    # A plan whose sharded weights tp does not divide, and one naming no submodule.
    dims = ParallelDims(tp=4, dp_shard=1).build()
    errors = []
    for plan in (
        toy.tp_plan(),  # vocab 130 is not divisible by 4
        {"layers.*.mlp": toy.tp_plan()["output"]},
    ):
        try:
            apply_tp(toy.make_model(cfg=toy.ToyConfig(vocab=130)), dims.mesh("tp"), plan)
        except ParallelError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


@pytest.mark.distributed
def test_named_meshes_on_four_ranks():
    results = run_distributed(_layouts_on_four_ranks, 4, timeout=120)
    r0, r3 = results[0], results[3]
    # tp ranks are neighbours; degree-1 axes are None and cost no process group.
    assert r0["tp2_dp_shard2"]["tp"] == [0, 1] and r3["tp2_dp_shard2"]["tp"] == [2, 3]
    assert r0["tp2_dp_shard2"]["dp_shard"] == [0, 2] == r0["tp2_dp_shard2"]["dp"]
    assert r0["tp2_dp_shard2"]["loss"] == [0, 2] and r0["tp2_dp_shard2"]["pp"] is None
    assert r0["tp2_dp_shard2"]["new_groups"] == 2
    assert r0["hsdp"]["fsdp"] == (("dp_replicate", "dp_shard"), [[0, 1], [2, 3]])
    # dp and loss span every rank here, so their flattened groups are the world group.
    assert r0["hsdp"]["dp"] == [0, 1, 2, 3] and r0["hsdp"]["new_groups"] == 2
    # cp ranks share FSDP shards and the loss, but not the data.
    assert r0["cp2_dp_shard2"]["cp"] == [0, 1] and r0["cp2_dp_shard2"]["dp"] == [0, 2]
    assert r0["cp2_dp_shard2"]["dp_shard_cp"] == [0, 1, 2, 3] == r0["cp2_dp_shard2"]["loss"]
    assert r0["cp2_dp_shard2"]["fsdp"] == (("dp_shard_cp",), [0, 1, 2, 3])
    assert r0["pp2_tp2"]["pp"] == [0, 2] and r0["pp2_tp2"]["dp"] is None
    # pipeline stages are the outer axis; data, loss and FSDP groups stay inside a stage
    pp2 = r3["pp2_dp_shard2"]
    assert pp2["pp"] == [1, 3] and pp2["dp"] == [2, 3] == pp2["loss"]
    assert pp2["fsdp"] == (("dp_shard",), [2, 3])
    # ep is the inner factor of dp_shard x cp.
    assert r0["ep2"]["ep"] == [0, 1] and r3["ep2"]["ep"] == [2, 3]
    assert "tok_embeddings.weight has size 130" in r0["errors"][0]
    assert "'layers.*.mlp' matches no submodule" in r0["errors"][1]
