"""`mindspeed plan` and `mindspeed profile` from the command line, and the planner against
measured step times on a CPU grid of layouts (slow: calibrates this machine, then measures
every layout of the grid on 2 and on 4 processes, twice; prints all numbers)."""

import json

import pytest

from mindspeed_core.cli import run as cli
from mindspeed_core.planning import Job, Layout, estimate_step_time
from mindspeed_core.testing import run_distributed
from mindspeed_llm.models import build_model_config
from mindspeed_llm.models.shape import model_shape
from mindspeed_tools.plan import _step_times, calibrate

GRID_MODEL = {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4,
              "intermediate_size": 512, "vocab_size": 2048, "max_position_embeddings": 512}  # fmt: skip
GRID_JOB = Job(seq_len=256, global_batch=8, device="cpu")
GRIDS = {
    2: [
        Layout(dp_shard=2, micro_batch=4),
        Layout(dp_shard=2, micro_batch=1),
        Layout(dp_replicate=2, micro_batch=4),
        Layout(tp=2, sequence_parallel=True, loss_parallel=True, micro_batch=8),
        Layout(tp=2, sequence_parallel=True, loss_parallel=True, micro_batch=2),
        Layout(pp=2, micro_batch=2),
        Layout(cp=2, micro_batch=8),
        Layout(dp_shard=2, micro_batch=4, ac="full"),
    ],
    4: [
        Layout(dp_shard=4, micro_batch=2),
        Layout(dp_shard=4, micro_batch=1),
        Layout(tp=2, dp_shard=2, sequence_parallel=True, loss_parallel=True, micro_batch=4),
        Layout(tp=4, sequence_parallel=True, loss_parallel=True, micro_batch=8),
        Layout(pp=2, dp_shard=2, micro_batch=2),
        Layout(cp=2, dp_shard=2, micro_batch=4),
        Layout(dp_replicate=2, dp_shard=2, micro_batch=2),
        Layout(dp_shard=4, micro_batch=2, ac="full"),
    ],
}


def test_plan_cli_default_and_impossible_budget(capsys):
    assert cli(["plan"]) == 0
    out = capsys.readouterr().out
    assert "layouts fit" in out and "fastest: torchrun" in out
    assert "--model.flavor llama3-8b" in out.splitlines()[-1]
    assert cli(["plan", "--model", "llama:debug", "--devices", "2", "--memory-gb", "0.0001",
                "--seq-len", "128", "--global-batch", "4", "--device", "cpu"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fits" in err[0] and "GiB" in err[0]
    assert cli(["plan", "--model", "llama:debug", "--devices", "4", "--memory-gb", "1",
                "--seq-len", "128", "--global-batch", "8", "--device", "cpu", "--json"]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert result["candidates"] and "mindspeed_llm.pretrain" in result["command"]
    assert cli(["plan", "--devices", "0"]) == 2


def test_profile_cli(tmp_path, capsys):
    import torch

    from mindspeed_core.profiling import ProfileConfig, build_profiler

    model = torch.nn.Linear(32, 32)
    profiler = build_profiler(ProfileConfig(steps="2:3"), rank=0, device=torch.device("cpu"),
                              run_dir=tmp_path)  # fmt: skip
    for _ in range(4):
        model(torch.randn(8, 32)).sum().backward()
        profiler.step()
    profiler.close()
    assert cli(["profile", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[1:3]]
    assert [r[:2] for r in rows] == [["0", "2"], ["0", "3"]]
    assert "top operators" in out and "aten::" in out
    assert cli(["profile", str(tmp_path / "nothing")]) == 2
    (tmp_path / "empty").mkdir()
    assert cli(["profile", str(tmp_path / "empty")]) == 2
    capsys.readouterr()
    assert cli(["profile", str(tmp_path), "--top", "-1"]) == 2  # listed all but one operator
    assert "--top must be >= 0, got -1" in capsys.readouterr().err
    import gzip

    bad = tmp_path / "bad" / "profile"
    bad.mkdir(parents=True)
    trace = bad / "rank0.pt.trace.json.gz"
    for content, expected in (
        (gzip.compress(b'{"traceEvents": []}')[:12], "not a readable chrome trace"),  # truncated
        (gzip.compress(b'{"traceEvents": 5}'), "traceEvents is not a list of events"),
    ):
        trace.write_bytes(content)
        assert cli(["profile", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err and str(trace) in err, err


def test_a_bad_calibration_is_one_line_and_a_bad_cached_one_is_measured_again(tmp_path, capsys,
                                                                              caplog):  # fmt: skip
    from mindspeed_core.planning import calibrate as cal

    argv = ["plan", "--model", "llama:debug", "--devices", "2", "--seq-len", "128",
            "--global-batch", "4", "--device", "cpu", "--calibration"]  # fmt: skip
    for content, expected in (
        ('{"flops_per_s": 1e9', "not a calibration JSON"),  # truncated
        ("[1, 2]", "a calibration is a JSON object, got list"),
        ('{"flops_per_sec": 1e9}', "unknown key 'flops_per_sec'"),
        ('{"flops_per_s": NaN}', "flops_per_s: expected a finite number, got nan"),
    ):
        path = tmp_path / "calibration.json"
        path.write_text(content)
        assert cli([*argv, str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err and str(path) in err, err
    with caplog.at_level("WARNING", logger="mindspeed.plan"):
        assert cal.load_cached(path) is None  # the planner then measures or uses defaults
    assert "ignoring the cached calibration" in caplog.text


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=x.__getitem__)
        r = [0.0] * len(x)
        for position, i in enumerate(order):
            r[i] = float(position)
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True)) / (n * (n * n - 1))


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_planner_ranks_measured_cpu_grid(world):
    config = build_model_config("llama", flavor="debug", **GRID_MODEL)
    calib = calibrate(config, GRID_JOB, "test-cpu", world=world)
    shape = model_shape(config)
    layouts = GRIDS[world]
    predicted = [estimate_step_time(shape, lay, GRID_JOB, calib).total for lay in layouts]
    repeats = [run_distributed(_step_times, world, config, layouts, GRID_JOB, timeout=3000)
               for _ in range(2)]  # fmt: skip
    measured = [min(max(rep[r][i] for r in range(world)) for rep in repeats)
                for i in range(len(layouts))]  # fmt: skip
    print(f"\ncalibration: {calib.to_dict()}")
    for lay, p, m in zip(layouts, predicted, measured, strict=True):
        print(f"world {world} {lay.describe():32s} predicted {p:7.3f}s measured {m:7.3f}s")
    chosen = min(range(len(layouts)), key=predicted.__getitem__)
    rho = spearman(predicted, measured)
    print(f"chosen {layouts[chosen].describe()}: {measured[chosen] / min(measured):.3f}x the "
          f"fastest measured; Spearman {rho:.3f}")  # fmt: skip
    assert measured[chosen] <= 1.10 * min(measured)
    assert rho >= 0.8


def test_calibration_fits_recover_known_constants():
    """fit_compute / fit_collectives get back the constants that generated the times, and
    the cost model's bubble shrinks with more micro-batches."""
    from mindspeed_core.planning import Calibration
    from mindspeed_core.planning import calibrate as cal

    shape = model_shape(build_model_config("llama", flavor="debug", **GRID_MODEL))
    truth = Calibration(flops_per_s=3e10, block_overhead_s=0.01, latency_s=1e-4, bandwidth=5e8)
    timings = [(n, truth.latency_s + n / 2 / truth.bandwidth) for n in (1 << 20, 1 << 24)]
    fitted = Calibration()
    cal.fit_collectives(timings, 2, fitted)
    assert fitted.bandwidth == pytest.approx(truth.bandwidth, rel=1e-6)
    assert fitted.latency_s == pytest.approx(truth.latency_s, rel=1e-6)
    layouts = [Layout(dp_shard=2, micro_batch=m) for m in (1, 4)]
    runs = [(shape, lay, GRID_JOB, estimate_step_time(shape, lay, GRID_JOB, truth).total)
            for lay in layouts]  # fmt: skip
    cal.fit_compute(runs, fitted)
    assert fitted.flops_per_s == pytest.approx(truth.flops_per_s, rel=1e-4)
    assert fitted.block_overhead_s == pytest.approx(truth.block_overhead_s, rel=1e-4)
    job = Job(seq_len=256, global_batch=32, device="cpu")
    few, many = (estimate_step_time(shape, Layout(pp=2, micro_batch=m), job, truth)
                 for m in (8, 1))  # fmt: skip
    assert few.bubble / few.compute > many.bubble / many.compute > 0
