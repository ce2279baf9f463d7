"""Recipes (`mindspeed recipes`), `mindspeed plan --config` and `mindspeed preflight`: every
shipped recipe loads as its command's config, its layout is valid on its devices and its header
states the planner's memory under its device size; preflight rehearses a layout on CPU
processes against one process and fails, naming the check, on a planted tp bug, a layout that
cannot divide the model and a memory estimate over the device size."""

from __future__ import annotations

import textwrap

import pytest

from mindspeed_core.cli import run as cli
from mindspeed_core.planning.memory import estimate_memory_per_stage
from mindspeed_llm.models.shape import model_shape
from mindspeed_llm.recipes import RECIPES_DIR, recipes
from mindspeed_llm.train.build import model_config
from mindspeed_tools import preflight
from mindspeed_tools.preflight import check_layout_valid, layout_of, load_job

NAMES = [r.name for r in recipes()]
PUBLISHED = {"llama3.1-8b", "qwen2.5-7b", "qwen2.5-72b", "qwen3-8b", "qwen3-30b-a3b",
             "mixtral-8x7b", "deepseek-v3"}  # fmt: skip


def test_the_published_models_have_recipes():
    assert {name.rsplit("-", 1)[0] for name in NAMES} >= PUBLISHED
    assert {r.command for r in recipes()} == {"pretrain", "sft"}


@pytest.mark.parametrize("name", NAMES)
def test_a_recipe_loads_its_layout_is_valid_and_fits_as_its_header_says(name):
    cfg, command, header, path = load_job(name)
    assert command == header["command"] and path.parent == RECIPES_DIR
    config = model_config(cfg.model)
    check_layout_valid(cfg, config, header["devices"])  # raises, naming the field, if not
    assert header["devices"] % header["nodes"] == 0
    layout, job = layout_of(cfg, header["devices"])
    estimates = estimate_memory_per_stage(model_shape(config), layout, job)
    peak = max(m.peak for m in estimates) / 2**30
    assert peak == pytest.approx(header["predicted_peak_gib"], abs=0.05)  # the header is current
    assert peak < header["memory_gb"]
    # start-up (meta build, this rank's shards, one tensor whole) fits too, and the peak
    # covers it: the model of every recipe can start on its cluster
    startup = max(m.startup for m in estimates) / 2**30
    assert 0 < startup <= peak < header["memory_gb"]
    assert str(cfg.data.paths[0]).startswith("/path/to/")  # left for the user, and it says so
    assert "data.paths" in header["fill_in"]


def test_recipes_command_lists_and_prints(capsys):
    assert cli(["recipes"]) == 0
    table = capsys.readouterr().out
    assert all(name in table for name in NAMES) and "predicted peak" in table
    assert cli(["recipes", "qwen3-8b-pretrain"]) == 0
    assert capsys.readouterr().out == (RECIPES_DIR / "qwen3-8b-pretrain.yaml").read_text()
    assert cli(["recipes", "no-such-model"]) == 2
    assert "no recipe named 'no-such-model'" in capsys.readouterr().err


def test_plan_scores_a_recipe_and_refuses_one_over_the_memory(capsys):
    assert cli(["plan", "--config", "mixtral-8x7b-pretrain"]) == 0
    out = capsys.readouterr().out
    assert "tp2 pp4 ep4 dp_shard8" in out and out.count("training peak") == 4  # one per stage
    assert out.count("predicted start-up peak") == 4
    assert cli(["plan", "--config", "qwen3-8b-pretrain", "--memory-gb", "16"]) == 2
    assert "does not fit --memory-gb 16" in capsys.readouterr().err


def _run(capsys, *argv) -> tuple[int, dict[str, str]]:
    """`mindspeed preflight ...`: (exit status, {check name: its printed line})."""
    status = cli(["preflight", *argv])
    out = capsys.readouterr().out
    lines = {}
    for line in out.splitlines():
        for name in ("layout valid", "memory", "losses equal", "gradients equal", "resumes in another layout"):
            if line.strip()[4:].strip().startswith(name):
                lines[name] = line
    return status, lines


def test_preflight_refuses_a_layout_that_cannot_divide_the_model(tmp_path, capsys):
    bad = tmp_path / "tp3.yaml"
    bad.write_text((RECIPES_DIR / "qwen3-8b-pretrain.yaml").read_text().replace(
        "parallel:\n", "parallel:\n  tp: 3\n"))  # fmt: skip
    status, lines = _run(capsys, str(bad), "--devices", "24", "--memory-gb", "64")
    assert status == 1
    assert "FAIL" in lines["layout valid"] and "tp=3" in lines["layout valid"]
    assert all("skip" in lines[n] for n in ("memory", "losses equal", "resumes in another layout"))


def test_preflight_bad_input_is_one_line_exit_2(tmp_path, capsys):
    assert cli(["preflight", str(tmp_path / "nowhere" / "run.yaml")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nowhere' / 'run.yaml'}: no such config file"
    assert cli(["preflight", "no-such-recipe"]) == 2
    assert "no recipe named 'no-such-recipe'" in capsys.readouterr().err
    plain = tmp_path / "plain.yaml"  # a config without a recipe header: devices must be said
    plain.write_text("parallel:\n  tp: 2\n")
    assert cli(["preflight", str(plain)]) == 2
    assert "say --devices and --memory-gb" in capsys.readouterr().err
    assert not list(tmp_path.glob("mindspeed-preflight-*"))


def test_a_config_that_is_not_utf8_is_one_line_naming_file_and_line(tmp_path, capsys):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("# recipe: latin1\ntrain:\n  steps: 10 # caf\u00e9\n".encode("latin-1"))
    for argv in (["plan", "--config", str(bad)], ["preflight", str(bad), "--devices", "8",
                                                  "--memory-gb", "80"]):  # fmt: skip
        assert cli(argv) == 2, argv
        err = capsys.readouterr().err
        assert err == f"error: {bad}:3: not UTF-8 text (byte 0xe9 at column 18); save the file as UTF-8\n"
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    assert cli(["preflight", str(binary)]) == 2
    assert f"{binary}:1: not UTF-8 text (byte 0x89 at column 1)" in capsys.readouterr().err
    assert not list(tmp_path.glob("mindspeed-preflight-*"))


def test_preflight_caps_nproc_by_the_machine_unless_told(monkeypatch, capsys):
    monkeypatch.setattr(preflight, "process_room", lambda: (8, 2, 17.5))
    assert cli(["preflight", "--nproc", "1000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--nproc 1000: this machine (2 cores, 17.5 GiB available) " \
        "holds at most 8 rehearsal processes" in err and "--oversubscribe" in err, err
    launched = []
    monkeypatch.setattr(preflight, "rehearse", lambda cfg, cmd, real, devices, nproc, work:
                        launched.append(nproc) or [])  # fmt: skip
    assert cli(["preflight", "qwen3-8b-pretrain", "--nproc", "1000", "--oversubscribe"]) == 0
    assert launched == [1000]
    monkeypatch.undo()
    room, cores, available = preflight.process_room()
    assert 1 <= room <= 4 * cores and available > 0


def test_preflight_fails_a_memory_estimate_over_the_device(monkeypatch, capsys):
    monkeypatch.setattr(preflight, "rehearse", lambda *a, **k: [])  # the memory check alone
    status, lines = _run(capsys, "qwen3-8b-pretrain", "--memory-gb", "16")
    assert status == 1 and "FAIL" in lines["memory"] and "of 16 GiB" in lines["memory"]
    status, lines = _run(capsys, "qwen3-8b-pretrain")
    assert status == 0 and "ok" in lines["memory"]


@pytest.mark.slow
def test_preflight_passes_a_moe_recipe(tmp_path, capsys):
    """With no config, the default recipe: Qwen3-30B-A3B's ep=8 over FSDP, rehearsed as ep=2
    over 4 processes."""
    assert preflight.DEFAULT_RECIPE == "qwen3-30b-a3b-pretrain"
    status, lines = _run(capsys, "--keep", str(tmp_path))
    assert status == 0, lines
    assert "ep=2 dp_shard=4" in lines["losses equal"]
    assert all("ok" in line for line in lines.values())


PLANTED = textwrap.dedent("""
    # A tensor-parallel plan whose row-parallel down projection never sums its shards (the
    # partial sums stay local): every shape still fits, only the numbers are wrong.
    import mindspeed_llm.models.common.parallelize as parallelize
    import mindspeed_llm.models.common.tp_plan as tp_plan
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.parallel import RowwiseParallel

    _plan = tp_plan.llama_tp_plan

    def llama_tp_plan(**kwargs):
        plan = _plan(**kwargs)
        plan["layers.*.feed_forward.w2"] = RowwiseParallel(output_layouts=Partial())
        return plan

    parallelize.llama_tp_plan = llama_tp_plan
""")


def test_preflight_catches_a_planted_tensor_parallel_bug(tmp_path, monkeypatch, capsys):
    """Llama-3.1-8B's tp=2 (without sequence parallel, where the shapes would not fit and the
    run would stop): right, then with the planted plan, whose losses are wrong."""
    config = tmp_path / "tp2.yaml"
    config.write_text((RECIPES_DIR / "llama3.1-8b-pretrain.yaml").read_text().replace(
        "sequence_parallel: true", "sequence_parallel: false"))  # fmt: skip
    status, lines = _run(capsys, str(config), "--nproc", "2", "--keep", str(tmp_path / "good"))
    assert status == 0 and "tp=2" in lines["losses equal"], lines
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "sitecustomize.py").write_text(PLANTED)  # imported by every rehearsal process
    monkeypatch.setenv("PYTHONPATH", str(planted))
    status, lines = _run(capsys, str(config), "--nproc", "2", "--keep", str(tmp_path / "bad"))
    # it ran, and the numbers differ: gradient norms by ~1e-3 from step 2, losses by ~1e-4
    assert status == 1 and "FAIL" in lines["gradients equal"], lines
    assert "vs one process" in lines["gradients equal"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_preflight_passes_every_recipe_on_4_processes(name, tmp_path, capsys):
    status, lines = _run(capsys, name, "--keep", str(tmp_path))
    assert status == 0, lines
