"""`mindspeed preflight CONFIG [--nproc N]`: rehearse a cluster config on this machine's CPU.

    mindspeed preflight                                  # no config: the Qwen3-30B-A3B recipe
    mindspeed preflight qwen3-30b-a3b-pretrain           # a shipped recipe (`mindspeed recipes`)
    mindspeed preflight my-run.yaml --nproc 4 --devices 64 --memory-gb 80

CONFIG is a config file of a training command (`pretrain` or `sft`: the recipe header's
`command:` or `--command`). Each check prints one line; the exit status is 0 only when every
check holds (1 when one fails, 2 for bad input):

1. layout valid: the config's layout on `--devices` (the recipe's `devices:`) divides the
   model, the batch and the world, as `mindspeed <command>` checks it at start;
2. memory: `mindspeed plan`'s estimate of the real model's peak per device on that layout
   fits `--memory-gb` (the recipe's `memory_gb:`);
3. losses equal / gradients equal: the same layout shrunk to `--nproc` CPU processes (every
   degree above 1 becomes 2 while processes last, in the order tp, ep (on two FSDP ranks), pp,
   cp, dp_replicate, then FSDP over what is left; schedule, virtual stages, sequence and loss
   parallel, recompute, compile, LoRA kept) trains the family's debug-size model, with the
   real model's switches, for a few steps from the embedded demo data, and its losses and
   gradient norms equal one process's (rtol 1e-4, fp32: bf16 rounds differently per layout);
4. resumes in another layout: that run's mid-way checkpoint resumes in one process and the
   remaining steps give the one-process run's losses.

Options the CPU cannot rehearse (activation/optimizer offload, `layers_per_stage`) are named
in the output, and the checks run without them. `--nproc` is capped by the machine (4
processes a core, ~1 GiB of available memory each) unless `--oversubscribe` says otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mindspeed_core.cli import ArgumentParser, Command, discover_commands
from mindspeed_core.config import dump_yaml, load_config
from mindspeed_core.errors import ConfigError, MindSpeedError
from mindspeed_core.planning import Job, Layout
from mindspeed_core.training import read_metrics

HELP = "rehearse a config's layout on a shrunken model in CPU processes (checks, exit 0 if all hold)"
COMMANDS = ("pretrain", "sft")
DEFAULT_RECIPE = "qwen3-30b-a3b-pretrain"
"""What `mindspeed preflight` with no arguments rehearses (about a minute on 2 cores)."""
STEPS = 4
RTOL = 1e-4
PROCESSES_PER_CORE = 4
"""Rehearsal processes (one thread each, mostly waiting on each other) a core may take."""
PROCESS_GIB = 1.0
"""Memory one rehearsal process takes at most (a debug-size model: ~0.5 GiB)."""
SIZE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
    "head_dim", "max_position_embeddings", "rope_scaling", "sliding_window", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "mlp_only_layers", "full_attention_layers", "rotary_dim", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_expert_groups",
    "topk_expert_groups", "query_pre_attn_scalar", "dtype",
)  # fmt: skip
"""Taken from the family's debug flavor; every other field (biases, norms, routing, MTP,
soft caps, RoPE style) stays the real model's."""

logger = logging.getLogger("mindspeed.preflight")


@dataclass
class Check:
    name: str
    ok: bool | None  # None: not run (an earlier check failed)
    detail: str


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="mindspeed preflight", description=HELP)
    p.add_argument("config", nargs="?", default=DEFAULT_RECIPE,
                   help=f"a config file, or the name of a shipped recipe (default: {DEFAULT_RECIPE})")
    p.add_argument("--command", choices=COMMANDS, help="its command (default: the recipe header's)")
    p.add_argument("--nproc", type=int, default=4,
                   help="CPU processes for the shrunken layout (default 4; at most 4 a core and "
                   "one per GiB of available memory)")  # fmt: skip
    p.add_argument("--oversubscribe", action="store_true",
                   help="start --nproc processes even beyond what this machine holds")
    p.add_argument("--devices", type=int, help="devices of the real job (default: the header's)")
    p.add_argument("--memory-gb", type=float, help="memory per device (default: the header's)")
    p.add_argument("--keep", type=Path, help="keep the rehearsal's run folders here")
    return p


def process_room() -> tuple[int, int, float]:
    """(rehearsal processes this machine holds, its cores, its available memory in GiB)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    available = _available_bytes() / 2**30
    return max(1, min(cores * PROCESSES_PER_CORE, int(available / PROCESS_GIB))), cores, available


def _available_bytes() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_nproc(nproc: int, oversubscribe: bool) -> None:
    """Refuse more rehearsal processes than the machine holds, unless told to oversubscribe.

    Raises:
        ConfigError: naming --nproc, the machine's cores and memory, and --oversubscribe.
    """
    if nproc < 1:
        raise ConfigError(f"--nproc={nproc} must be positive")
    room, cores, available = process_room()
    if nproc > room and not oversubscribe:
        raise ConfigError(
            f"--nproc {nproc}: this machine ({cores} cores, {available:.1f} GiB available) holds "
            f"at most {room} rehearsal processes ({PROCESSES_PER_CORE} a core, ~{PROCESS_GIB:g} "
            f"GiB each); add --oversubscribe to start {nproc} anyway"
        )


def load_job(spec: str, command: str | None = None):
    """(config, command, header, path) of a config file or a shipped recipe's name."""
    from mindspeed_llm.recipes import find_recipe, read_header

    path = Path(spec)
    if not path.is_file():
        if path.suffix in (".yaml", ".yml") and os.sep in spec:
            raise ConfigError(f"{spec}: no such config file")
        path = find_recipe(spec)
    header = read_header(path)
    command = command or header.get("command") or "pretrain"
    if command not in COMMANDS:
        raise ConfigError(f"{path}: preflight rehearses {', '.join(COMMANDS)}, not {command!r}")
    config_cls = discover_commands()[command].load().config_cls
    return load_config(config_cls, path), command, header, path


def layout_of(cfg, devices: int) -> tuple[Layout, Job]:
    """The planner's `Layout` and `Job` of a training config on `devices` processes."""
    p, t = cfg.parallel, cfg.train
    dims = p.dims(world_size=devices)
    layout = Layout(tp=p.tp, pp=p.pp, virtual_stages=p.virtual_stages, pp_schedule=p.pp_schedule,
                    cp=p.cp, ep=p.ep, dp_shard=dims.dp_shard, dp_replicate=p.dp_replicate,
                    sequence_parallel=p.sequence_parallel and p.tp > 1,
                    loss_parallel=p.loss_parallel and p.tp > 1, ac=t.ac, micro_batch=t.micro_batch,
                    activation_offload=p.activation_offload, optimizer_offload=p.cpu_offload)  # fmt: skip
    device = t.device if t.device in ("cpu", "cuda", "npu") else "cuda"  # auto: an accelerator
    return layout, Job(seq_len=cfg.data.seq_len, global_batch=t.global_batch, precision=t.precision,
                       device=device)  # fmt: skip


def check_layout_valid(cfg, model, devices: int) -> str:
    """What `mindspeed pretrain`/`sft` check before anything runs, for `devices` processes."""
    from mindspeed_core.errors import ParallelError
    from mindspeed_llm.models.common.layout import check_layout
    from mindspeed_llm.train.trainer import grad_accum_steps, pipeline_microbatches

    try:
        dims = cfg.parallel.dims(world_size=devices)
    except ParallelError as err:
        raise ConfigError(f"{devices} devices: {err}") from None
    check_layout(model, cfg.parallel, seq_len=cfg.data.seq_len, recompute=cfg.train.ac != "none")
    accum = grad_accum_steps(cfg.train, dims.dp)
    pipeline_microbatches(cfg.parallel, cfg.train, accum)
    return (f"tp={dims.tp} pp={dims.pp} cp={dims.cp} ep={dims.ep} dp_shard={dims.dp_shard} "
            f"dp_replicate={dims.dp_replicate} on {devices} devices, {accum} micro-batches a step")  # fmt: skip


def shrink_layout(parallel, devices: int, nproc: int):
    """(the layout on at most `nproc` processes, processes used, what could not be kept)."""
    dims = parallel.dims(world_size=devices)
    budget, new, dropped = nproc, {"ep": 1}, []
    for name in ("tp", "ep", "pp", "cp", "dp_replicate"):  # ep: 2 FSDP ranks holding 2 experts each
        want = getattr(dims, name)
        fits = want > 1 and budget >= 2 and budget % 2 == 0
        new[name] = 2 if fits else 1
        budget //= new[name]
        if want > 1 and not fits:
            dropped.append(f"{name}={want}")
    if dims.dp_shard > 1 or new["ep"] > 1:
        new["dp_shard"] = budget * new["ep"]
        if dims.dp_shard > 1 and new["dp_shard"] == 1:
            dropped.append(f"dp_shard={dims.dp_shard}")
    else:
        new["dp_shard"] = 1
        if budget > 1:
            dropped.append(f"{budget}x fewer processes (the layout has no FSDP to fill them)")
    for name in ("activation_offload", "cpu_offload"):
        if getattr(parallel, name):
            dropped.append(f"{name} (needs an accelerator)")
    if parallel.layers_per_stage:
        dropped.append("layers_per_stage (the shrunken model splits evenly)")
    options = dict(new, activation_offload=False, cpu_offload=False, layers_per_stage=[],
                   sequence_parallel=parallel.sequence_parallel and new["tp"] > 1,
                   virtual_stages=parallel.virtual_stages if new["pp"] > 1 else 1,
                   pp_microbatches=None, ulysses_degree=None)  # fmt: skip
    if parallel.pp_schedule != "1F1B" and new["pp"] == 1:
        options["pp_schedule"] = "1F1B"
    shrunk = dataclasses.replace(parallel, **options)
    used = new["tp"] * new["pp"] * new["cp"] * new["dp_replicate"] * new["dp_shard"]
    return shrunk, used, dropped


def shrink_model(real, parallel):
    """The real model's switches at the family's debug size, fitted to `parallel`."""
    from mindspeed_llm.models import build_model_config

    debug = build_model_config(real.family, flavor="debug")
    small = dataclasses.replace(real, **{f: getattr(debug, f) for f in SIZE_FIELDS},
                                padded_vocab_size=None)  # fmt: skip
    stages = parallel.pp * parallel.virtual_stages
    layers = stages * math.ceil(max(small.num_layers, stages) / stages)
    kv = max(small.num_kv_heads, parallel.tp)
    heads = max(small.num_heads, kv) // kv * kv
    experts = small.num_experts
    if experts and experts % parallel.ep:
        experts = parallel.ep * math.ceil(experts / parallel.ep)
    return dataclasses.replace(small, num_layers=layers, num_kv_heads=kv, num_heads=heads,
                               num_experts=experts)  # fmt: skip


def _rehearsal_config(cfg, command: str, model_json: Path, parallel, seq_len: int, batch: int):
    """The config of one rehearsal run: the shrunken model, the demo data, fp32, STEPS steps."""
    default = type(cfg)()
    model = dataclasses.replace(cfg.model, hf_config=model_json, hf_path=None, flavor=None)
    data = dataclasses.replace(default.data, seq_len=seq_len)
    if hasattr(cfg.data, "mode"):
        data = dataclasses.replace(data, mode=cfg.data.mode)
    train = dataclasses.replace(cfg.train, steps=STEPS, micro_batch=1, global_batch=batch,
                                precision="fp32", eval_interval=0, exit_at_step=None, device="cpu",
                                fp8=False)  # fmt: skip
    optim = dataclasses.replace(cfg.optim, warmup_steps=1, decay_steps=None)
    checkpoint = dataclasses.replace(cfg.checkpoint, dir=None, interval=STEPS // 2, keep_last=4,
                                     load="auto", async_save=False)  # fmt: skip
    logging_ = dataclasses.replace(cfg.logging, log_interval=1, tensorboard=False, progress=False)
    profile = type(cfg.profile)() if hasattr(cfg, "profile") else None
    fields = dict(model=model, data=data, parallel=parallel, train=train, optim=optim,
                  checkpoint=checkpoint, logging=logging_)  # fmt: skip
    if profile is not None:
        fields["profile"] = profile
    return dataclasses.replace(cfg, **fields)


def _launch(command: str, config_file: Path, run_dir: Path, nproc: int, log: Path) -> None:
    """`mindspeed COMMAND --config FILE` under torchrun on `nproc` CPU processes."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MINDSPEED_DEVICE="cpu")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "mindspeed_core.cli", command,
            "--config", str(config_file), f"--logging.run_dir={run_dir}"]  # fmt: skip
    with open(log, "w") as out:
        done = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"the {nproc}-process run failed: {_first_error(log)} (log: {log})")


def _first_error(log: Path) -> str:
    """The first error line of a failed run's log (ours, or a rank's exception)."""
    lines = log.read_text(errors="replace").splitlines()
    pattern = re.compile(r"^(\[rank\d+\]: )?(error: |[\w.]*(Error|Exception): )")
    found = [line for line in lines if pattern.match(line) and "ChildFailedError" not in line]
    return (found or lines[-1:] or ["no output"])[0].strip()


def _metrics(run_dir: Path) -> dict[int, dict]:
    """The last record of each step (a resumed run logs its steps again)."""
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def _compare(a: dict[int, dict], b: dict[int, dict], key: str, steps) -> tuple[bool, str]:
    worst, where = 0.0, None
    for step in steps:
        if step not in a or step not in b or key not in a[step] or key not in b[step]:
            return False, f"step {step} has no {key} in both runs"
        x, y = a[step][key], b[step][key]
        err = abs(x - y) / max(abs(y), 1e-12)
        if not math.isfinite(x) or err > worst:
            worst, where = (math.inf if not math.isfinite(x) else err), (step, x, y)
    if worst <= RTOL:
        return True, f"max relative difference {worst:.1e} over steps {steps[0]}-{steps[-1]}"
    step, x, y = where
    return False, f"step {step}: {x:.6g} vs one process {y:.6g} (relative {worst:.1e} > {RTOL:g})"


def rehearse(cfg, command: str, real, devices: int, nproc: int, work: Path) -> list[Check]:
    """Checks 3 and 4 (see the module docstring) in `work`."""
    parallel, used, dropped = shrink_layout(cfg.parallel, devices, nproc)
    model = shrink_model(real, parallel)
    model_json = work / "config.json"
    model_json.write_text(json.dumps(model.to_hf_dict(), indent=1))
    one = dataclasses.replace(parallel, tp=1, pp=1, cp=1, ep=1, dp_shard=1, dp_replicate=1,
                              sequence_parallel=False, virtual_stages=1, pp_schedule="1F1B")  # fmt: skip
    seq_len = 64 * parallel.cp * parallel.tp
    dp = parallel.dp_shard * parallel.dp_replicate
    batch = dp * max(2, parallel.pp * parallel.virtual_stages)
    shape = (f"{parallel.tp=} {parallel.pp=} {parallel.cp=} {parallel.ep=} {parallel.dp_shard=} "
             f"{parallel.dp_replicate=}").replace("parallel.", "")  # fmt: skip
    what = f"{used} processes ({shape}), {model.num_layers} layers x {model.hidden_size}"
    if dropped:
        what += f"; not rehearsed: {', '.join(dropped)}"
    files = {}
    for name, layout in (("layout", parallel), ("one", one)):
        rehearsal = _rehearsal_config(cfg, command, model_json, layout, seq_len, batch)
        files[name] = work / f"{name}.yaml"
        files[name].write_text(dump_yaml(rehearsal))
    runs = {"one": work / "one", "layout": work / "layout", "resumed": work / "resumed"}
    try:
        _launch(command, files["one"], runs["one"], 1, work / "one.log")
        _launch(command, files["layout"], runs["layout"], used, work / "layout.log")
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        return [Check("losses equal", False, f"{what}: {err}"), Check("gradients equal", None, ""),
                Check("resumes in another layout", None, "")]  # fmt: skip
    one_m, layout_m = _metrics(runs["one"]), _metrics(runs["layout"])
    steps = list(range(1, STEPS + 1))
    checks = [Check("losses equal", *_compare(layout_m, one_m, "loss", steps)),
              Check("gradients equal", *_compare(layout_m, one_m, "grad_norm", steps))]  # fmt: skip
    checks[0].detail = f"{what}; {checks[0].detail}"
    # the layout run's mid-way checkpoint, resumed by one process
    half = STEPS // 2
    shutil.copytree(runs["layout"], runs["resumed"])
    ckpt = runs["resumed"] / "checkpoints"
    for folder in ckpt.glob("step_*"):
        if int(folder.name.split("_")[1]) > half:
            shutil.rmtree(folder)
    if not (ckpt / f"step_{half}").is_dir():
        checks.append(Check("resumes in another layout", False, f"no checkpoint at step {half}"))
        return checks
    (ckpt / "latest").write_text(f"step_{half}\n")
    try:
        _launch(command, files["one"], runs["resumed"], 1, work / "resumed.log")
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        checks.append(Check("resumes in another layout", False, str(err)))
        return checks
    ok, detail = _compare(_metrics(runs["resumed"]), one_m, "loss", steps[half:])
    checks.append(Check("resumes in another layout", ok, f"step {half} checkpoint of the "
                        f"{used}-process run, resumed in 1 process; {detail}"))  # fmt: skip
    return checks


def preflight(cfg, command: str, devices: int, memory_gb: float, nproc: int, work: Path) -> list[Check]:
    """Every check, in order; later ones are skipped once the layout is invalid."""
    from mindspeed_core.planning.memory import estimate_memory_per_stage
    from mindspeed_llm.models.shape import model_shape
    from mindspeed_llm.train.build import model_config

    real = model_config(cfg.model)
    try:
        checks = [Check("layout valid", True, check_layout_valid(cfg, real, devices))]
    except MindSpeedError as err:
        return [Check("layout valid", False, " ".join(str(err).split())),
                Check("memory", None, ""), Check("losses equal", None, ""),
                Check("gradients equal", None, ""), Check("resumes in another layout", None, "")]  # fmt: skip
    layout, job = layout_of(cfg, devices)
    shape = model_shape(real)
    estimates = estimate_memory_per_stage(shape, layout, job)
    peak = max(s.peak for s in estimates) / 2**30  # start-up is one of its moments
    startup = max(s.startup for s in estimates) / 2**30
    checks.append(Check("memory", peak <= memory_gb,
                        f"predicted start-up peak {startup:.1f} GiB, training peak {peak:.1f} GiB "
                        f"per device of {memory_gb:g} GiB ({shape.num_params() / 1e9:.1f}B "
                        f"parameters, {layout.describe()})"))  # fmt: skip
    return checks + rehearse(cfg, command, real, devices, nproc, work)


def run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    check_nproc(args.nproc, args.oversubscribe)
    cfg, command, header, path = load_job(args.config, args.command)
    devices = args.devices or header.get("devices")
    memory_gb = args.memory_gb or header.get("memory_gb")
    if not devices or not memory_gb:
        raise ConfigError(f"{path}: say --devices and --memory-gb (the file has no recipe header)")
    if devices < 1 or memory_gb <= 0:
        raise ConfigError(f"--devices={devices} and --memory-gb={memory_gb} must be positive")
    print(f"preflight of {path} ({command}) for {devices} devices of {memory_gb:g} GiB, "
          f"rehearsed on up to {args.nproc} CPU processes", flush=True)
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        checks = preflight(cfg, command, devices, memory_gb, args.nproc, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="mindspeed-preflight-") as work:
            checks = preflight(cfg, command, devices, memory_gb, args.nproc, Path(work))
    for c in checks:
        mark = {True: "ok  ", False: "FAIL", None: "skip"}[c.ok]
        print(f"  {mark} {c.name:<27} {c.detail}".rstrip())
    failed = [c.name for c in checks if c.ok is not True]
    print("preflight passed" if not failed else f"preflight failed: {', '.join(failed)}")
    return 0 if not failed else 1


command = Command(help=HELP, run=run)
