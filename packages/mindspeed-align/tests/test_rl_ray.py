"""`grpo.placement: ray` (mindspeed-align[ray]): the rollout, the reference and the rewards as Ray
actors on a local cluster give the colocated run's losses, a reward that cannot load is one
line, and a rollout actor killed mid-run ends the run with one line naming it; with
`rollout_engine: vllm` the rollout actor hosts the (stand-in) vLLM engine.

One local cluster serves the module (starting one costs 5-20 s on 2 cores; each actor
a few seconds more, to import torch)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from mindspeed_align.rl.cli import main, ppo_main
from mindspeed_align.rl.data import demo_records
from mindspeed_core.cli import guarded
from mindspeed_core.testing import import_sibling
from mindspeed_core.training import read_metrics
from mindspeed_llm.demo import ensure_demo_data

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")  # as `placement.RayRoles` sets
ray = pytest.importorskip("ray")


@pytest.fixture(scope="module", autouse=True)
def cluster():
    # logical CPUs: each actor takes one (two PPO trainer actors and their roles: 10)
    # and a made-up accelerator, as a GPU or NPU cluster's nodes declare theirs
    ray.init(num_cpus=10, resources={"fake_accel": 4}, include_dashboard=False, log_to_driver=False,
             configure_logging=False)  # fmt: skip
    yield
    ray.shutdown()


def _reward_model(folder):
    """A random reward model (`test_rl_rewards`): scores every text, so rewards vary."""
    if not (folder / "rm").exists():
        import_sibling(__file__, "test_rl_rewards")._reward_model_folder(folder, ensure_demo_data().tokenizer)
    return folder / "rm"


def _args(folder, run, section, *extra):
    prompts = folder / "prompts.jsonl"
    if not prompts.exists():
        prompts.write_text("".join(json.dumps(r) + "\n" for r in demo_records(24, seed=7)))
    return [
        f"--data.prompts={prompts}", f"--data.tokenizer={ensure_demo_data().tokenizer}",
        "--data.eval_prompts=4", "--data.seq_len=48", f"--{section}.n=4",
        f"--{section}.max_new_tokens=3", f"--{section}.reward_workers=0",
        f"--{section}.kl_coef=0.1", f"--{section}.kl_estimator=k3",
        f"--{section}.rewards=[final_number,exact_match]", f"--{section}.reward_weights=[1.0,0.5]",
        f"--{section}.reward_model={_reward_model(folder)}",
        "--train.global_batch=16", "--train.micro_batch=8", "--train.steps=2",
        "--model.ops_impl=reference", f"--logging.run_dir={folder / run}",
        "--logging.log_interval=1", "--logging.progress=false", "--logging.tensorboard=false",
        *extra,
    ]  # fmt: skip


KEYS = ("loss", "grad_norm", "kl", "reward/mean", "reward/model", "entropy")
CRITIC_KEYS = ("critic/loss", "critic/grad_norm", "critic/values", "critic/returns")
LOSS_ABS = 3e-7
"""An actor runs one thread (Ray's one CPU), so its matmuls sum in another order than the
trainer's two threads: the critic's values then differ in the 7th digit, and PPO's policy
loss (whitened advantages: about 0, here 1e-7) by about that much absolutely."""


def _same_runs(tmp_path, capsys, command, section, *extra):
    """A colocated and a Ray run of `command`: the same metrics, step by step."""
    assert guarded(command, _args(tmp_path, f"{section}-local", section)) == 0
    assert "Ray actor" not in capsys.readouterr().err
    assert guarded(command, _args(tmp_path, f"{section}-ray", section,
                                  f"--{section}.placement=ray", *extra)) == 0  # fmt: skip
    err = capsys.readouterr().err
    # the roles' lines come from this process, or (trainer actors) from rank 0's actor
    roles = ("policy trains on 1 Ray actors",) if extra else (
        "rollout runs", "reference runs", "rewards run") + (("critic runs",) if section == "ppo" else ())  # fmt: skip
    for role in roles:
        assert f"{section}: the {role}" in err, err
    local = read_metrics(tmp_path / f"{section}-local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / f"{section}-ray" / "metrics.jsonl")
    assert len(local) == len(remote) == 2
    assert local[-1]["kl"] != 0 and local[0]["reward/std"] > 0  # reference and rewards live
    for a, b in zip(local, remote, strict=True):
        for key in KEYS + (CRITIC_KEYS if section == "ppo" else ()):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=LOSS_ABS), (section, a["step"], key)
    # the whole policy went to the rollout actor at every step (fp32: 4 bytes a weight)
    assert all(m["rollout/weight_sync_bytes"] > 0 for m in remote)
    assert all(m["rollout/weight_sync_bytes"] == 0 for m in local)  # it samples with the policy


def test_ray_placement_gives_the_colocated_losses(tmp_path, capsys):
    """GRPO with a KL reference and two weighted rewards: the same samples, rewards,
    reference log-probs, losses and gradients either way."""
    _same_runs(tmp_path, capsys, main, "grpo")


@pytest.mark.slow
def test_the_policy_on_a_ray_actor_gives_the_colocated_losses(tmp_path, capsys):
    """`grpo.trainer_actors 1`: the trainer is a Ray actor with its own process group, which
    places its rollout, reference and reward actors; the launching process only waits. The
    same metrics step by step as the colocated run."""
    _same_runs(tmp_path, capsys, main, "grpo", "--grpo.trainer_actors=1")


@pytest.mark.slow
def test_two_trainer_actors_train_as_one_process_group(tmp_path):
    """`grpo.trainer_actors 2` with `parallel.dp_shard 2`: FSDP over two Ray actors; each
    rank sends the whole policy to its own rollout actor every step, so the step's summed
    sync bytes are twice one copy's (the one-actor run's)."""
    for run, extra in (("one", ["--grpo.trainer_actors=1"]),
                       ("two", ["--grpo.trainer_actors=2", "--parallel.dp_shard=2"])):  # fmt: skip
        assert guarded(main, _args(tmp_path, run, "grpo", "--grpo.placement=ray", *extra)) == 0
    one = read_metrics(tmp_path / "one" / "metrics.jsonl")
    two = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert [m["step"] for m in two] == [1, 2]
    assert all(b["rollout/weight_sync_bytes"] == 2 * a["rollout/weight_sync_bytes"] > 0
               for a, b in zip(one, two, strict=True))  # fmt: skip
    assert abs(two[0]["kl"]) < 1e-7 < two[1]["kl"]  # the policy moved off its start


def test_ppo_critic_on_its_own_actor_equals_colocated(tmp_path, capsys):
    """PPO (KL in the reward) with the critic on a Ray actor of its own (its own process
    group), beside the rollout, reference and reward actors: the colocated run's losses, the
    critic's included."""
    _same_runs(tmp_path, capsys, ppo_main, "ppo")


@pytest.mark.slow
def test_ppo_critic_on_its_own_actor_resumes_exactly(tmp_path):
    """A run stopped after step 1 and resumed repeats step 2: the critic's model, optimizer
    and schedule went through the checkpoint from and back to its actor."""
    assert guarded(ppo_main, _args(tmp_path, "ppo-ray", "ppo", "--ppo.placement=ray")) == 0
    whole = read_metrics(tmp_path / "ppo-ray" / "metrics.jsonl")
    for extra in ("--train.exit_at_step=1", "--train.steps=2"):
        assert guarded(ppo_main, _args(tmp_path, "ppo-split", "ppo", "--ppo.placement=ray",
                                       extra)) == 0  # fmt: skip
    split = read_metrics(tmp_path / "ppo-split" / "metrics.jsonl")
    assert [m["step"] for m in split] == [1, 2]
    for key in KEYS + CRITIC_KEYS:
        assert split[1][key] == pytest.approx(whole[1][key], rel=1e-6, abs=LOSS_ABS), key


@pytest.mark.slow
def test_ppo_critic_actors_form_their_own_group_and_resume_exactly(tmp_path):
    """Two PPO trainer actors with `dp_shard 2`, so two critic actors sharding the critic with
    FSDP in a process group of their own: a run stopped after step 1 and resumed (each
    critic rank's shard gathered to a whole tensor for the checkpoint and sharded again on
    load) repeats the whole run's step 2."""
    layout = ["--ppo.placement=ray", "--ppo.trainer_actors=2", "--parallel.dp_shard=2"]
    assert guarded(ppo_main, _args(tmp_path, "whole", "ppo", *layout)) == 0
    for extra in ("--train.exit_at_step=1", "--train.steps=2"):
        assert guarded(ppo_main, _args(tmp_path, "split", "ppo", *layout, extra)) == 0
    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    split = read_metrics(tmp_path / "split" / "metrics.jsonl")
    assert [m["step"] for m in split] == [1, 2]
    assert whole[1]["critic/loss"] != whole[0]["critic/loss"]  # the critic trained
    for key in KEYS + CRITIC_KEYS:
        assert split[1][key] == pytest.approx(whole[1][key], rel=1e-6, abs=LOSS_ABS), key


def test_every_role_holding_a_model_gets_the_configured_accelerator(tmp_path, capsys):
    """`ray_resources` reaches every role placed (the one `RayRoles.place`): the rollout and
    the reference actors were given one unit of a custom accelerator resource each, the
    reward actor (no model) none; Ray's own record of each actor says so."""
    import re

    args = _args(tmp_path, "accel", "grpo", "--grpo.placement=ray", "--train.steps=1",
                 "--grpo.reward_model=null", "--grpo.rewards=[final_number]",
                 "--grpo.reward_weights=[1.0]", "--grpo.ray_resources={fake_accel: 1}")  # fmt: skip
    assert guarded(main, args) == 0
    err = capsys.readouterr().err
    given = dict(re.findall(r"grpo: the (\w+) runs? on Ray actor \w+ \(([^)]*)\)", err))
    assert set(given) == {"rollout", "reference", "rewards"}, err
    assert "fake_accel 1" in given["rollout"] and "fake_accel 1" in given["reference"], given
    assert "fake_accel" not in given["rewards"] and "CPU 1" in given["rewards"], given
    assert guarded(main, [*args[:-1], "--grpo.ray_resources={fake_accel: 0}"]) == 2
    assert "grpo.ray_resources.fake_accel=0" in capsys.readouterr().err


@pytest.mark.slow
def test_a_lora_policy_sends_its_rollout_actor_the_adapters_alone(tmp_path, capsys):
    """`--lora.rank 8` with a Ray rollout: the actor got the whole base once (before the
    first evaluation) and each step only the adapters' bytes; its samples, the Ray
    reference (the base, built as the run started) and so the losses are the colocated LoRA
    run's, whose reference is the policy with its adapters off."""
    from mindspeed_llm.models import Transformer, build_model_config
    from mindspeed_llm.peft import LoRAConfig, apply_lora

    lora = ("--lora.rank=8", "--grpo.reward_model=null", "--grpo.rewards=[final_number]",
            "--grpo.reward_weights=[1.0]")  # fmt: skip
    assert guarded(main, _args(tmp_path, "lora-local", "grpo", *lora)) == 0
    assert guarded(main, _args(tmp_path, "lora-ray", "grpo", "--grpo.placement=ray", *lora)) == 0
    local = read_metrics(tmp_path / "lora-local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "lora-ray" / "metrics.jsonl")
    model = Transformer(build_model_config("llama", flavor="debug"))
    apply_lora(model, LoRAConfig(rank=8))
    adapters = sum(p.numel() * 4 for n, p in model.named_parameters() if ".lora_" in n)
    whole = sum(p.numel() * 4 for p in model.parameters())
    assert [m["rollout/weight_sync_bytes"] for m in remote] == [adapters] * 2
    assert adapters < whole / 5  # rank 8 on the debug model's 64-wide layers: a tenth
    assert local[-1]["kl"] > 0
    for a, b in zip(local, remote, strict=True):
        for key in ("loss", "grad_norm", "kl", "reward/mean", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=LOSS_ABS), (a["step"], key)


def test_ray_reward_that_cannot_load_is_one_line(tmp_path, capsys):
    args = _args(tmp_path, "bad", "grpo", "--grpo.placement=ray",
                 f"--grpo.reward_model={tmp_path / 'missing'}")  # fmt: skip
    assert guarded(main, args) == 2
    err = capsys.readouterr().err.strip()
    assert "grpo.reward_model: no folder" in err and "\n" not in err, err
    assert not (tmp_path / "bad").exists()


def test_several_processes_need_a_running_cluster(monkeypatch):
    """A torchrun job does not start a Ray cluster per rank: it asks for RAY_ADDRESS."""
    from mindspeed_align.rl.placement import RayRoles
    from mindspeed_core.errors import ConfigError

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match="ppo.placement=ray with 2 training processes needs a "
                                          "running Ray cluster"):  # fmt: skip
        RayRoles("ppo", 2)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_killed_trainer_takes_its_local_cluster_with_it(tmp_path, how):
    """A trainer that started its own Ray cluster, killed mid-run: the cluster's processes (GCS,
    raylet, the agents that Ray's own fate sharing leaves for about a minute, the actors) are
    gone within 5 s (mindspeed_core.lifeline.Reaper)."""
    import signal
    import subprocess
    import time

    from mindspeed_core.testing.processes import alive, descendants, gone_within

    args = _args(tmp_path, f"killed_{how}", "grpo", "--grpo.placement=ray", "--train.steps=1000")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local cluster
    trainer = subprocess.Popen([sys.executable, "-m", "mindspeed_align.rl.cli", *args], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / f"killed_{how}" / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.5)  # the actors are up once a step has been logged
        helpers = descendants(trainer.pid)
        assert len(helpers) >= 5 and trainer.poll() is None, helpers
        os.kill(trainer.pid, getattr(signal, how))
        trainer.wait(timeout=30)
        assert gone_within(helpers, 5.0) is not None, alive(helpers)
    finally:
        trainer.kill()


@pytest.mark.slow
def test_a_killed_rollout_actor_ends_the_run_with_one_line(tmp_path, capsys, monkeypatch):
    """The rollout actor killed after the first step: the next step's weight sync or rollout
    fails with one line naming the role, exit 2, well within a minute (no hang)."""
    import threading
    import time

    from mindspeed_align.rl import placement

    made = []
    real = placement.RayRoles.rollout

    def noting(self, *args, **kwargs):
        made.append(real(self, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(placement.RayRoles, "rollout", noting)
    metrics = tmp_path / "killed" / "metrics.jsonl"

    def kill_after_the_first_step():
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        ray.kill(made[0].actor)
        killed.append(time.monotonic())

    killed = []
    killer = threading.Thread(target=kill_after_the_first_step, daemon=True)
    killer.start()
    code = guarded(main, _args(tmp_path, "killed", "grpo", "--grpo.placement=ray", "--train.steps=200"))
    seconds = time.monotonic() - killed[0]  # from the kill to the run's end
    killer.join(timeout=5)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and seconds < 60, (code, seconds)
    assert len(errors) == 1 and errors[0].startswith("error: grpo.placement=ray: the rollout actor died"), errors


@pytest.mark.slow
def test_a_killed_trainer_actor_ends_the_run_with_one_line(tmp_path, capsys):
    """The policy's trainer actor killed mid-run: the launching process says which rank's
    actor died, in one line, exit 2, within a minute (its roles go with it)."""
    import threading
    import time

    metrics = tmp_path / "killed" / "metrics.jsonl"

    def kill_after_the_first_step():
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        name = next(n for n in ray.util.list_named_actors() if n.startswith("mindspeed-grpo-trainer-0-"))
        ray.kill(ray.get_actor(name))
        killed.append(time.monotonic())

    killed = []
    killer = threading.Thread(target=kill_after_the_first_step, daemon=True)
    killer.start()
    code = guarded(main, _args(tmp_path, "killed", "grpo", "--grpo.placement=ray",
                               "--grpo.trainer_actors=1", "--train.steps=200"))  # fmt: skip
    seconds = time.monotonic() - killed[0]  # from the kill to the run's end
    killer.join(timeout=5)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and seconds < 60, (code, seconds)
    assert errors == ["error: grpo.placement=ray: the trainer rank 0 actor died"], errors


def _vllm(tmp_path):
    """The stand-in vLLM (`test_rl_vllm.FAKE_VLLM`) and the flags of a run on it."""
    python, seen = import_sibling(__file__, "test_rl_vllm").make_fake_vllm(tmp_path)
    # no reference (one actor fewer); the reward model's scores vary with the scripted text
    flags = ("--grpo.rollout_engine=vllm", f"--grpo.vllm_python={python}", "--model.flavor=debug-h32",
             "--grpo.kl_coef=0.0")  # fmt: skip
    return python, seen, flags


def test_the_rollout_actor_samples_on_its_vllm_engine(tmp_path, capsys):
    """`rollout_engine: vllm` with `placement: ray`: the rollout actor starts the engine (the
    stand-in), fills its copy of the policy from the trainer's weights each step and has
    vLLM reload them (under Hugging Face names); the run's losses are the colocated vLLM
    run's step by step."""
    python, seen, flags = _vllm(tmp_path)
    assert guarded(main, _args(tmp_path, "vllm-local", "grpo", *flags)) == 0
    (seen / "reloaded.json").unlink()
    assert guarded(main, _args(tmp_path, "vllm-ray", "grpo", "--grpo.placement=ray", *flags)) == 0
    assert "grpo: the rollout runs on Ray actor" in capsys.readouterr().err
    assert len((seen / "pids").read_text().split()) == 2  # an engine a run: the actor's too
    names = json.loads((seen / "reloaded.json").read_text())
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    local = read_metrics(tmp_path / "vllm-local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "vllm-ray" / "metrics.jsonl")
    assert len(local) == len(remote) == 2 and local[0]["response/length_mean"] == 3
    assert local[0]["reward/std"] > 0 and local[0]["grad_norm"] > 0  # a live gradient
    for a, b in zip(local, remote, strict=True):
        assert b["rollout/weight_sync_bytes"] > 0
        for key in ("loss", "grad_norm", "reward/mean", "response/length_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=LOSS_ABS), (a["step"], key)


@pytest.mark.slow
def test_a_dead_vllm_engine_in_the_rollout_actor_is_one_line_naming_it(tmp_path):
    """The actor's vLLM engine killed: the next rollout raises `RoleDied` naming the engine;
    an engine that cannot start is one line too."""
    import signal

    from mindspeed_align.rl.placement import RayRoles, RoleDied
    from mindspeed_align.rl.rollout import SamplingConfig

    python, seen, _ = _vllm(tmp_path)
    policy = import_sibling(__file__, "test_rl_vllm")._policy()
    roles = RayRoles("grpo", 1)
    try:
        rollout = roles.rollout(policy, seq_len=64, precision="fp32", vllm_python=python)
        assert rollout.sync_weights() > 0
        os.kill(int((seen / "pid").read_text()), signal.SIGKILL)
        with pytest.raises(RoleDied) as err:
            rollout.generate([[1, 2]], SamplingConfig(n=1, max_new_tokens=2), seed=0)
        message = str(err.value)
        assert message.startswith("grpo.rollout_engine=vllm: the vLLM rollout engine died"), message
        assert "\n" not in message
        with pytest.raises(RoleDied) as err:  # an interpreter without vllm
            roles.rollout(policy, seq_len=64, precision="fp32", vllm_python=Path(sys.executable))
        message = str(err.value)
        assert "the vLLM rollout engine failed: ModuleNotFoundError" in message, message
        assert "\n" not in message
    finally:
        roles.close()
