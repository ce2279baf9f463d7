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


@pytest.fixture()
def fake_vllm(tmp_path, monkeypatch):
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
    python.write_text(f"#!/bin/sh\nPYTHONPATH={package.parent} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    monkeypatch.setenv("FAKE_VLLM_OUT", str(out))
    return python, out


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
        ("--grpo.rollout_engine=vllm", "--grpo.placement=ray"):
            "grpo.rollout_engine=vllm runs colocated rollouts only yet (not grpo.placement=ray)",
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


@pytest.mark.slow
def test_demo_learns_with_vllm_rollouts(tmp_path, monkeypatch):
    from mindspeed_align.rl.cli import grpo
    from mindspeed_align.rl.config import GRPOConfig, GRPOLoggingSection, GRPOSection

    monkeypatch.chdir(tmp_path)
    cfg = GRPOConfig(grpo=GRPOSection(rollout_engine="vllm", vllm_python=_real_vllm()),
                     logging=GRPOLoggingSection(progress=False))  # fmt: skip
    summary = grpo(cfg)  # (`command` is a Command: it returns an exit code, not the summary)
    assert summary["reward_after"][0] > 0.8, summary
