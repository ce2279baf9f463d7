"""`grpo.rollout_engine: vllm` (`rl/vllm_rollout.py`).

In CI, without vLLM: the bad inputs (one line, exit 2), and the engine's plumbing against a
stand-in `vllm` package (scripted tokens): what crosses the socket, the weights written under
Hugging Face names, a dead engine ending the run in one line that names it, and no engine
process outliving a killed trainer. Slow, with the real vLLM (its environment created once,
or MINDSPEED_VLLM_PYTHON): greedy tokens equal our engine's before and after a weight sync
(a prompt longer than a prefix-cache block included), and the demo learns.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from mindspeed_align.rl.cli import main
from mindspeed_align.rl.data import demo_records
from mindspeed_align.rl.placement import RoleDied
from mindspeed_align.rl.rollout import LocalRollout, SamplingConfig
from mindspeed_core.cli import guarded
from mindspeed_core.parallel import ParallelConfig
from mindspeed_llm.demo import ensure_demo_data
from mindspeed_llm.models import build_model_config
from mindspeed_llm.train.build import build_model

FAKE_VLLM = '''
"""A stand-in for vLLM: token t of a sample is (prompt's first id + 7 * sample + t) % 512.
It appends each generate call's prompts, max_tokens and n to calls.jsonl, and "generate",
"generated" and "reload" to events as they happen; a file "slow" holding seconds makes
each generate call take that long."""
__version__ = "fake"
import json, os, time
from safetensors import safe_open

def _seen(name, text):
    with open(os.path.join(os.environ["FAKE_VLLM_OUT"], name), "a") as f:
        f.write(text + "\\n")

class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)

class _Out:
    def __init__(self, outputs):
        self.outputs = outputs

class _Sample:
    def __init__(self, ids):
        self.token_ids = ids
        self.logprobs = [{t: type("L", (), {"logprob": -0.5})()} for t in ids]

class LLM:
    def __init__(self, model, **kw):
        self.model, self.kw = model, kw
        open(os.path.join(os.environ["FAKE_VLLM_OUT"], "pid"), "w").write(str(os.getpid()))
        open(os.path.join(os.environ["FAKE_VLLM_OUT"], "pids"), "a").write(f"{os.getpid()} ")

    def generate(self, prompts, params, use_tqdm=False):
        if os.path.exists(os.path.join(os.environ["FAKE_VLLM_OUT"], "hang")):
            time.sleep(3600)
        _seen("events", "generate")
        _seen("calls.jsonl", json.dumps({"prompts": [p["prompt_token_ids"] for p in prompts],
                                         "max_tokens": [sp.max_tokens for sp in params],
                                         "n": [sp.n for sp in params]}))
        slow = os.path.join(os.environ["FAKE_VLLM_OUT"], "slow")
        if os.path.exists(slow):
            time.sleep(float(open(slow).read()))
        _seen("events", "generated")
        outs = []
        for p, sp in zip(prompts, params):
            first = p["prompt_token_ids"][0]
            outs.append(_Out([_Sample([(first + 7 * s + t) % 512 for t in range(sp.max_tokens)])
                              for s in range(sp.n)]))
        return outs

    def collective_rpc(self, name, kwargs):
        _seen("events", "reload")
        with safe_open(os.path.join(kwargs["weights_path"], "model.safetensors"), "pt") as f:
            names = sorted(f.keys())
        with open(os.path.join(os.environ["FAKE_VLLM_OUT"], "reloaded.json"), "w") as out:
            out.write(__import__("json").dumps(names))

    def reset_prefix_cache(self):
        open(os.path.join(os.environ["FAKE_VLLM_OUT"], "reset"), "a").write("x")
'''


def make_fake_vllm(tmp_path) -> tuple[Path, Path]:
    """An interpreter whose `vllm` is the stand-in above (our own Python, so safetensors is
    there), and the folder the stand-in writes what it saw to."""
    package = tmp_path / "fake" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VLLM)
    (package / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                       "    return {'prompt_token_ids': prompt_token_ids}\n")  # fmt: skip
    (package / "platforms.py").write_text("class _CPU:\n    def is_cpu(self):\n        return True\n\n"
                                          "current_platform = _CPU()\n")  # fmt: skip
    out = tmp_path / "seen"
    out.mkdir()
    python = tmp_path / "python"
    # the folder named in the script: a Ray actor has its cluster's environment, not ours
    python.write_text(f"#!/bin/sh\nFAKE_VLLM_OUT={out} PYTHONPATH={package.parent} "
                      f"exec {sys.executable} \"$@\"\n")  # fmt: skip
    python.chmod(0o755)
    return python, out


@pytest.fixture()
def fake_vllm(tmp_path):
    return make_fake_vllm(tmp_path)


def _policy(flavor: str = "debug-h32"):
    parallel = ParallelConfig()
    dims = parallel.dims(1).build("cpu")
    return build_model(build_model_config("llama", flavor), dims, torch.device("cpu"),
                       parallel=parallel, seq_len=64, precision="fp32", seed=3)  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}").exists() else "X"
    return state not in ("Z", "X")


def test_the_engine_gets_prompts_and_weights_and_answers_with_samples(fake_vllm):
    from mindspeed_align.rl.vllm_rollout import VLLMRollout

    python, seen = fake_vllm
    policy = _policy()
    rollout = VLLMRollout(policy, python, max_model_len=64)
    try:
        cfg = SamplingConfig(n=2, max_new_tokens=3, temperature=1.0, stop_token_ids=(12,))
        batch = rollout.generate([[5, 6], [9]], cfg, seed=1)
        assert batch.response_ids == [[5, 6, 7], [12, 13, 14], [9, 10, 11], [16, 17, 18]]
        assert batch.group == [0, 0, 1, 1] and batch.prompt_ids[1] == [5, 6]
        assert batch.sampler_logprobs == [[-0.5] * 3] * 4
        assert batch.stopped == [False, False, False, False]
        assert rollout.sync_weights() > 0
        names = json.loads((seen / "reloaded.json").read_text())  # Hugging Face's names
        assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" in names
        assert (seen / "reset").read_text() == "x"  # the prefix cache reset after the reload
        assert rollout.last_bytes == sum(p.numel() * 4 for p in policy.model.parameters())
    finally:
        rollout.close()
    assert not _alive(int((seen / "pid").read_text()))


def test_a_dead_engine_is_one_line_naming_it(fake_vllm):
    from mindspeed_align.rl.vllm_rollout import VLLMRollout

    python, seen = fake_vllm
    rollout = VLLMRollout(_policy(), python, max_model_len=64)
    os.kill(int((seen / "pid").read_text()), signal.SIGKILL)
    with pytest.raises(RoleDied) as err:
        rollout.generate([[1]], SamplingConfig(n=1, max_new_tokens=2), seed=0)
    message = str(err.value)
    assert "grpo.rollout_engine=vllm: the vLLM rollout engine died" in message and "\n" not in message
    assert "its log:" in message


def test_no_engine_outlives_a_killed_trainer(fake_vllm, tmp_path):
    python, seen = fake_vllm
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_rl_vllm import _policy
        from mindspeed_align.rl.vllm_rollout import VLLMRollout
        from pathlib import Path
        VLLMRollout(_policy(), Path({str(python)!r}), max_model_len=64)
        print("up", flush=True)
        time.sleep(600)
    """))
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "up"
        engine = int((seen / "pid").read_text())
        assert _alive(engine)
        folder = Path(os.readlink(f"/proc/{engine}/cwd"))  # the weights' folder
        assert (folder / "model" / "model.safetensors").is_file()
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 5
    while (_alive(engine) or folder.exists()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(engine) and not folder.exists()


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grpo-vllm")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in demo_records(24, seed=7)))
    return folder, prompts, ensure_demo_data().tokenizer


def _args(task, *extra):
    folder, prompts, tokenizer = task
    return [f"--data.prompts={prompts}", f"--data.tokenizer={tokenizer}", "--data.eval_prompts=4",
            "--data.seq_len=48", "--grpo.n=4", "--grpo.max_new_tokens=3", "--grpo.reward_workers=0",
            "--train.global_batch=8", "--train.micro_batch=8", "--train.steps=2",
            f"--logging.run_dir={folder / 'bad'}", "--logging.progress=false",
            "--logging.tensorboard=false", *extra]  # fmt: skip


def test_bad_inputs_are_one_line(task, capsys):
    ours = sys.executable  # an interpreter without vLLM
    cases = {
        ("--grpo.rollout_engine=sglang",): "grpo.rollout_engine: expected one of ['native', 'vllm']",
        (f"--grpo.vllm_python={ours}",): "grpo.vllm_python needs grpo.rollout_engine=vllm",
        ("--grpo.rollout_engine=vllm", "--grpo.vllm_python=/no/such/python"):
            "grpo.vllm_python=/no/such/python: no such interpreter",
        ("--grpo.rollout_engine=vllm", f"--grpo.vllm_python={ours}"):
            "vLLM's CPU attention needs heads of at least 32 channels; this model's head_dim is 16",
        ("--grpo.rollout_engine=vllm", f"--grpo.vllm_python={ours}", "--model.flavor=debug-h32"):
            "the vLLM rollout engine failed: ModuleNotFoundError: No module named 'vllm'",
    }  # fmt: skip
    for args, expected in cases.items():
        assert guarded(main, _args(task, *args)) == 2, args
        err = capsys.readouterr().err.strip()
        assert expected in err and "\n" not in err, (args, err)
    assert not (task[0] / "bad" / "checkpoints").exists()


@pytest.mark.parametrize("command", ["grpo", "ppo"])
def test_a_run_trains_on_the_engines_samples(task, fake_vllm, command):
    """The whole path through the trainer: the engine's samples are trained on, its weights
    synced each step, and it ends with the run."""
    from mindspeed_align.rl.cli import ppo_main
    from mindspeed_core.training import read_metrics

    python, seen = fake_vllm
    run = task[0] / f"fake-{command}"
    args = [a.replace("--grpo.", f"--{command}.") for a in _args(task)]
    args = [a for a in args if not a.startswith("--logging.run_dir")] + [
        f"--logging.run_dir={run}", f"--{command}.rollout_engine=vllm",
        f"--{command}.vllm_python={python}", "--model.flavor=debug-h32", "--logging.log_interval=1"]
    assert guarded(ppo_main if command == "ppo" else main, args) == 0
    metrics = read_metrics(run / "metrics.jsonl")
    assert len(metrics) == 2 and all(m["rollout/weight_sync_bytes"] > 0 for m in metrics)
    assert metrics[0]["response/length_mean"] == 3  # the stand-in never stops early
    assert not _alive(int((seen / "pid").read_text()))  # ended with the run


def _fake_run_args(task, run, python, *extra):
    args = [a for a in _args(task) if not a.startswith("--logging.run_dir")]
    return [*args, f"--logging.run_dir={run}", "--grpo.rollout_engine=vllm", "--model.flavor=debug-h32",
            f"--grpo.vllm_python={python}", "--logging.log_interval=1",
            "--grpo.rewards=[rl_reward_fixtures:text_length]", *extra]  # fmt: skip


def _vllm_group_runs(task, python, run, layout):
    """On each rank of a tp or cp group: a 2-step run on the stand-in, noting the batches
    this rank trained on; then a run whose engine is killed as the first step samples,
    which must end every rank with the same one-line error."""
    from mindspeed_align.rl import vllm_group, vllm_rollout

    seen, calls = [], []
    shared = vllm_group.SharedVLLMRollout.generate

    def noting(self, prompts, cfg, *, seed):
        batch = shared(self, prompts, cfg, seed=seed)
        seen.append((batch.prompt_ids, batch.response_ids))
        return batch

    vllm_group.SharedVLLMRollout.generate = noting
    code = guarded(main, _fake_run_args(task, run, python, layout))
    vllm_group.SharedVLLMRollout.generate = shared
    engine = vllm_rollout.VLLMRollout.generate

    def killing(self, prompts, cfg, *, seed):  # the run's third call: its first step's
        calls.append(1)
        if len(calls) == 3:
            os.kill(self.process.pid, signal.SIGKILL)
        return engine(self, prompts, cfg, seed=seed)

    vllm_rollout.VLLMRollout.generate = killing
    try:
        main(_fake_run_args(task, run.with_name(run.name + "-killed"), python, layout))
        died = "no error"
    except RoleDied as err:
        died = str(err)
    return code, seen, died


def _tp_cp_case(task, fake_vllm, layout, monkeypatch):
    from mindspeed_core.testing import run_distributed
    from mindspeed_core.training import read_metrics

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the ranks import the reward

    python, out = fake_vllm
    one = task[0] / "fake-one"
    if not one.exists():
        assert guarded(main, _fake_run_args(task, one, python)) == 0
    (out / "pids").unlink(missing_ok=True)
    name = layout.split("=")[0].split(".")[-1]
    ranks = run_distributed(_vllm_group_runs, 2, task, python, task[0] / f"fake-{name}", layout,
                            timeout=600)  # fmt: skip
    pids = (out / "pids").read_text().split()
    assert len(pids) == 2, pids  # one engine a run (the second killed), not one a rank
    (code0, seen0, died0), (code1, seen1, died1) = ranks
    assert code0 == code1 == 0 and len(seen0) == 2 + 2 + 2  # evaluations and steps
    assert seen0 == seen1  # both ranks trained on the first rank's samples
    for died in (died0, died1):
        assert died.startswith("grpo.rollout_engine=vllm: the vLLM rollout engine died"), died
        assert "\n" not in died
    a = read_metrics(one / "metrics.jsonl")
    b = read_metrics(task[0] / f"fake-{name}" / "metrics.jsonl")
    assert len(a) == len(b) == 2
    assert a[0]["reward/std"] > 0 and a[1]["loss"] != a[0]["loss"]  # the policy learns
    for x, y in zip(a, b, strict=True):
        for key in ("loss", "grad_norm", "reward/mean", "response/length_mean"):
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-5), (x["step"], key)


@pytest.mark.distributed
def test_one_engine_per_tensor_parallel_group(task, fake_vllm, monkeypatch):
    """`parallel.tp 2`: the first rank's engine samples, both ranks train on its batch (the
    losses of one process on the stand-in, 1e-5), and an engine killed mid-run ends both
    ranks with its one line."""
    _tp_cp_case(task, fake_vllm, "--parallel.tp=2", monkeypatch)


def _group_rollout(python, layout: dict):
    """Under `layout`: a sync and a rollout on the group's engine (the stand-in)."""
    import torch.distributed as dist

    from mindspeed_align.rl.vllm_group import SharedVLLMRollout, engine_group
    from mindspeed_align.rl.vllm_rollout import VLLMRollout

    parallel = ParallelConfig(**layout)
    dims = parallel.dims(dist.get_world_size()).build("cpu")
    policy = build_model(build_model_config("llama", "debug-h32"), dims, torch.device("cpu"),
                         parallel=parallel, seq_len=64, precision="fp32", seed=3)  # fmt: skip
    rollout = SharedVLLMRollout(policy, lambda: VLLMRollout(policy, python, max_model_len=64),
                                engine_group(dims))  # fmt: skip
    try:
        rollout.sync_weights()
        batch = rollout.generate([[5, 6], [9]], SamplingConfig(n=2, max_new_tokens=3), seed=1)
        return batch.response_ids, rollout.last_bytes, rollout.engine is not None
    finally:
        rollout.close()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", [{"cp": 2}, {"cp": 2, "tp": 2}], ids=["cp2", "cp2-tp2"])
def test_one_engine_per_context_parallel_group(fake_vllm, layout):
    """A cp (and a cp x tp) group shares its first rank's engine: one engine, the same
    batch and synced bytes on every rank (RL refuses cp > 1 in its config for now, so this
    drives the rollout itself)."""
    from mindspeed_core.testing import run_distributed

    python, seen = fake_vllm
    ranks = run_distributed(_group_rollout, math.prod(layout.values()), python, layout,
                            timeout=600)  # fmt: skip
    assert len((seen / "pids").read_text().split()) == 1
    assert [engine for *_, engine in ranks] == [True] + [False] * (len(ranks) - 1)
    whole = sum(p.numel() * 4 for p in _policy().model.parameters())
    for tokens, synced, _ in ranks:
        assert tokens == [[5, 6, 7], [12, 13, 14], [9, 10, 11], [16, 17, 18]]
        assert synced == whole


def test_a_device_without_a_known_vllm_package_asks_for_an_environment(monkeypatch):
    from mindspeed_align.rl.vllm_rollout import ensure_vllm_python
    from mindspeed_core.errors import ConfigError

    monkeypatch.delenv("MINDSPEED_VLLM_PYTHON", raising=False)
    with pytest.raises(ConfigError, match="on npu: name an environment with vLLM"):
        ensure_vllm_python("npu", None)


def _real_vllm() -> Path:
    from mindspeed_align.rl.vllm_rollout import ensure_vllm_python
    from mindspeed_core.errors import ConfigError

    try:
        return ensure_vllm_python("cpu", None)
    except ConfigError as err:
        pytest.skip(f"vLLM's environment cannot be created here: {err}")


@pytest.mark.slow
def test_vllm_greedy_tokens_equal_ours_before_and_after_a_sync():
    from mindspeed_align.rl.vllm_rollout import VLLMRollout

    policy = _policy()
    ours = LocalRollout(policy)
    engine = VLLMRollout(policy, _real_vllm(), max_model_len=64)
    try:
        prompts = [[1, 5, 9, 33, 70, 2, 8], list(range(3, 40))]  # 37 tokens: > a 16-token block
        greedy = SamplingConfig(n=1, max_new_tokens=12, temperature=0.0)
        a, b = ours.generate(prompts, greedy, seed=0), engine.generate(prompts, greedy, seed=0)
        assert a.response_ids == b.response_ids
        torch.testing.assert_close(torch.tensor(b.sampler_logprobs), torch.tensor(a.sampler_logprobs),
                                   rtol=0, atol=1e-4)  # fmt: skip
        with torch.no_grad():
            for p in policy.model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        engine.sync_weights()
        after = ours.generate(prompts, greedy, seed=0)
        assert after.response_ids != a.response_ids  # the update changed the answers
        assert engine.generate(prompts, greedy, seed=0).response_ids == after.response_ids
        # seeded samples of 80 distinct 60-token prompts: over one step's token budget, which
        # split a prefill and killed vLLM's CPU engine; and a prompt near max_model_len
        many = [[3 + (7 * i + j) % 300 for j in range(60)] for i in range(80)]
        sampled = engine.generate(many, SamplingConfig(n=1, max_new_tokens=12), seed=1)
        assert [len(r) for r in sampled.response_ids] == [4] * 80  # 64 - 60 fit
    finally:
        engine.close()


GREEDY_PROMPTS = [[1, 5, 9, 33, 70, 2, 8], list(range(3, 40))]


def _tp_greedy(python):
    """Greedy samples of the tp=2 policy (the one-process seed's weights) on its group's engine."""
    from mindspeed_align.rl.vllm_group import SharedVLLMRollout, engine_group
    from mindspeed_align.rl.vllm_rollout import VLLMRollout

    parallel = ParallelConfig(tp=2)
    dims = parallel.dims(2).build("cpu")
    policy = build_model(build_model_config("llama", "debug-h32"), dims, torch.device("cpu"),
                         parallel=parallel, seq_len=64, precision="fp32", seed=3)  # fmt: skip
    rollout = SharedVLLMRollout(policy, lambda: VLLMRollout(policy, python, max_model_len=64),
                                engine_group(dims))  # fmt: skip
    try:
        greedy = SamplingConfig(n=1, max_new_tokens=12, temperature=0.0)
        return rollout.generate(GREEDY_PROMPTS, greedy, seed=0).response_ids, rollout.engine is not None
    finally:
        rollout.close()


@pytest.mark.slow
@pytest.mark.distributed
def test_vllm_greedy_tokens_under_tp2_equal_one_process():
    """Real vLLM: the tp=2 group's engine, fed weights gathered from the shards, answers as
    the one-process policy does (ours and vLLM's greedy tokens)."""
    from mindspeed_core.testing import run_distributed

    python = _real_vllm()
    greedy = SamplingConfig(n=1, max_new_tokens=12, temperature=0.0)
    one = LocalRollout(_policy()).generate(GREEDY_PROMPTS, greedy, seed=0).response_ids
    (tokens0, engine0), (tokens1, engine1) = run_distributed(_tp_greedy, 2, python, timeout=900)
    assert engine0 and not engine1  # the first rank's engine alone
    assert tokens0 == tokens1 == one


@pytest.mark.slow
def test_demo_learns_with_vllm_rollouts(tmp_path, monkeypatch):
    from mindspeed_align.rl.cli import grpo
    from mindspeed_align.rl.config import GRPOConfig, GRPOLoggingSection, GRPOSection

    monkeypatch.chdir(tmp_path)
    cfg = GRPOConfig(grpo=GRPOSection(rollout_engine="vllm", vllm_python=_real_vllm()),
                     logging=GRPOLoggingSection(progress=False))  # fmt: skip
    summary = grpo(cfg)  # (`command` is a Command: it returns an exit code, not the summary)
    assert summary["reward_after"][0] > 0.8, summary
