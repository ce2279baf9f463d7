"""`mindspeed pretrain --profile.steps` writes per-rank traces of that window, and
`mindspeed profile RUN` reads them back into the compute / communication / idle table."""

import json

import pytest

pytestmark = pytest.mark.distributed


def test_a_profiled_dp2_run_writes_traces_that_mindspeed_profile_reads(
    torchrun, mindspeed, tmp_path
):
    run = tmp_path / "run"
    records = torchrun(
        2, run, "--train.steps=4", "--train.eval_interval=0", "--profile.steps=2:3",
        "--profile.ranks=[0,1]",
    )  # fmt: skip
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # profiling changes no step
    traces = sorted((run / "tb" / "profile").glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"]
    done = mindspeed("profile", run, "--json")
    assert done.returncode == 0, done.stderr
    summaries = sorted(json.loads(done.stdout), key=lambda s: s["rank"])
    assert [s["rank"] for s in summaries] == [0, 1]
    for summary in summaries:
        assert [r["step"] for r in summary["steps"]] == [2, 3]  # the window, 1-based
        for r in summary["steps"]:  # dp2 all-reduces gradients: communication shows
            assert r["comm_ms"] > 0 and r["compute_ms"] > 0
            parts = r["compute_ms"] + r["comm_ms"] + r["idle_ms"]
            assert parts == pytest.approx(r["total_ms"], rel=0.05)
        assert summary["top_ops"]

def test_offload_on_cpu_is_one_line(pretrain_cli, tmp_path):
    done = pretrain_cli(tmp_path / "run", "--parallel.activation_offload=true")
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert "parallel.activation_offload" in done.stderr and "accelerator" in done.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
