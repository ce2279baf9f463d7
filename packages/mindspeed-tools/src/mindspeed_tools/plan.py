"""`mindspeed plan`: which parallel layout to train with, predicted before spending a cluster.

    mindspeed plan                                    # the embedded example (Llama 3 8B)
    mindspeed plan --model llama:llama3-8b --devices 64 --memory-gb 80 \\
        --seq-len 4096 --global-batch 512 --precision bf16
    mindspeed plan --model path/to/hf_folder --devices 8 --memory-gb 24 --calibrate
    mindspeed plan --config qwen3-8b-pretrain         # one config's (a recipe's) own layout

Every layout the model, batch and trainer allow (tp, pp, cp, ep, dp_shard x dp_replicate,
recompute, micro-batch) is scored by `mindspeed_core.planning`: predicted peak memory per
device (kept if it fits --memory-gb) and step time (calibrated cost model). The table lists
the fastest; the last line is the command that trains with the winner. `--calibrate` first
measures this machine (all-gathers, then a two-layer copy of the model under FSDP at two
micro-batch sizes) and caches the constants per device name; otherwise the cached constants, or
round defaults for the device type, are used. A budget nothing fits is one line, exit 2.
`--config FILE` (or a recipe's name, `mindspeed recipes`) scores that training config's own
layout instead of searching: its memory per pipeline stage and step time on `--devices` of
`--memory-gb` (default: the recipe header's); one that does not fit is one line, exit 2.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
from pathlib import Path

from mindspeed_core.cli import ArgumentParser, Command
from mindspeed_core.errors import ConfigError
from mindspeed_core.planning import Calibration, Job, Layout, plan
from mindspeed_core.planning import calibrate as cal

HELP = "rank parallel layouts by predicted memory and step time; print the fastest's command"
DEFAULTS = {"model": "llama:llama3-8b", "devices": 64, "memory_gb": 80.0, "seq_len": 4096,
            "global_batch": 512, "precision": "bf16", "device": "cuda", "devices_per_node": 8}  # fmt: skip
logger = logging.getLogger("mindspeed.plan")


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="mindspeed plan", description=HELP)
    p.add_argument("--model", help="FAMILY[:FLAVOR] or a Hugging Face config.json / folder")
    p.add_argument("--devices", type=int, help="devices (processes) in all")
    p.add_argument("--memory-gb", type=float, help="memory per device, GiB")
    p.add_argument("--seq-len", type=int, help="tokens per sample")
    p.add_argument("--global-batch", type=int, help="samples per optimizer step")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--device", choices=("cpu", "cuda", "npu"), help="device type of the job")
    p.add_argument("--devices-per-node", type=int, help="tensor parallel stays inside a node")
    p.add_argument("--offload", action="store_true", help="also consider activation/optimizer offload")
    p.add_argument("--top", type=int, default=10, help="rows in the table")
    p.add_argument("--calibrate", action="store_true", help="measure this machine first")
    p.add_argument("--calibration", type=Path, help="a calibration JSON to use")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--config", help="score this training config's (or recipe's) layout only")
    p.add_argument("--search", action="store_true",
                   help="with --config: also search every layout of its job and print the "
                        "planner's choice beside the config's own")  # fmt: skip
    return p


def model_config(spec: str):
    """A TransformerConfig from FAMILY[:FLAVOR] or a Hugging Face config path."""
    from mindspeed_llm.models import build_model_config
    from mindspeed_llm.models.config import TransformerConfig

    if Path(spec).exists():
        return TransformerConfig.from_hf(spec)
    family, _, flavor = spec.partition(":")
    return build_model_config(family, flavor=flavor or "debug")


def run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.config is not None:
        return _run_config(args)
    opts = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in DEFAULTS.items()}
    if opts["devices"] < 1 or opts["memory_gb"] <= 0:
        raise ConfigError(f"--devices={opts['devices']} and --memory-gb={opts['memory_gb']} must be positive")
    from mindspeed_llm.models.shape import model_shape

    config = model_config(opts["model"])
    job = Job(seq_len=opts["seq_len"], global_batch=opts["global_batch"],
              precision=opts["precision"], device=opts["device"])  # fmt: skip
    calib = _calibration(args, config, job)
    per_node = min(opts["devices_per_node"], opts["devices"])
    candidates = plan(model_shape(config, opts["model"]), job, opts["devices"], opts["memory_gb"],
                      calibration=calib, devices_per_node=per_node, offload=args.offload,
                      accept=trainer_accepts(config, job.seq_len))  # fmt: skip
    command = pretrain_command(opts, candidates[0].layout, per_node, moe=bool(config.num_experts))
    if args.json:
        rows = [{"layout": dataclasses.asdict(c.layout), "peak_gib": c.memory.peak / 2**30,
                 "startup_gib": c.memory.startup / 2**30, "step_s": c.time.total}
                for c in candidates[: args.top]]  # fmt: skip
        print(json.dumps({"calibration": calib.to_dict(), "candidates": rows, "command": command}))
        return 0
    print(format_table(candidates[: args.top], job, calib, len(candidates)))
    print(f"\nfastest: {command}")
    return 0


def _run_config(args) -> int:
    """`--config`: the config's own layout, scored."""
    from mindspeed_core.planning.cost import estimate_step_time
    from mindspeed_core.planning.memory import estimate_memory_per_stage
    from mindspeed_llm.models.shape import model_shape
    from mindspeed_llm.train.build import model_config as config_of
    from mindspeed_tools.preflight import check_layout_valid, layout_of, load_job

    cfg, _, header, path = load_job(args.config)
    devices = args.devices or header.get("devices")
    memory_gb = args.memory_gb or header.get("memory_gb")
    if not devices or not memory_gb:
        raise ConfigError(f"{path}: say --devices and --memory-gb (the file has no recipe header)")
    config = config_of(cfg.model)
    check_layout_valid(cfg, config, devices)
    layout, job = layout_of(cfg, devices)
    job = dataclasses.replace(job, device=args.device or DEFAULTS["device"])
    shape = model_shape(config)
    estimates = estimate_memory_per_stage(shape, layout, job)
    stages = [m.peak / 2**30 for m in estimates]
    startup = [m.startup / 2**30 for m in estimates]
    per_node = devices // header["nodes"] if header.get("nodes") else None
    calib = _calibration(args, config, job)
    seconds = estimate_step_time(shape, layout, job, calib, per_node).total
    choice = _search_choice(args, config, shape, job, devices, memory_gb, calib, per_node, layout)
    if args.json:
        print(json.dumps({"config": str(path), "layout": dataclasses.asdict(layout), "devices": devices,
                          "memory_gb": memory_gb, "peak_gib_per_stage": stages,
                          "startup_gib_per_stage": startup, "step_s": seconds,
                          **({"planner": choice} if choice else {})}))  # fmt: skip
    else:
        print(f"{path.name}: {layout.describe()} on {devices} devices of {memory_gb:g} GiB "
              f"({shape.num_params() / 1e9:.1f}B parameters, seq {job.seq_len}, global batch "
              f"{job.global_batch}, {job.precision})")  # fmt: skip
        for i, (peak, start) in enumerate(zip(stages, startup, strict=True)):
            print(f"  stage {i}: predicted start-up peak {start:.1f} GiB, training peak "
                  f"{peak:.1f} GiB per device")  # fmt: skip
        print(f"  predicted step time {seconds:.2f} s (calibration: {job.device} defaults or cache)")
        if choice:
            rank = f"#{choice['config_rank']}" if choice["config_rank"] else "not among them"
            print(f"  planner's choice of the {choice['fitting']} layouts that fit: "
                  f"{choice['describe']}, peak {choice['peak_gib']:.1f} GiB, step "
                  f"{choice['step_s']:.2f} s (this config's layout: {rank})")  # fmt: skip
    if max(stages) > memory_gb:
        raise ConfigError(f"{path.name}: the predicted peak {max(stages):.1f} GiB per device does not fit "
                          f"--memory-gb {memory_gb:g}")  # fmt: skip
    return 0


_SAME_LAYOUT = ("tp", "pp", "cp", "ep", "dp_shard", "dp_replicate", "virtual_stages", "ac",
                "micro_batch")  # fmt: skip


def _search_choice(args, config, shape, job, devices, memory_gb, calib, per_node, layout):
    """`--search`: the planner's fastest layout for the config's job (and where the config's
    own layout ranks among those that fit), or None without --search."""
    if not args.search:
        return None
    candidates = plan(shape, job, devices, memory_gb, calibration=calib, devices_per_node=per_node,
                      offload=False, accept=trainer_accepts(config, job.seq_len))  # fmt: skip
    key = lambda lay: tuple(getattr(lay, k) for k in _SAME_LAYOUT)  # noqa: E731
    ranks = [i for i, c in enumerate(candidates, 1) if key(c.layout) == key(layout)]
    best = candidates[0]
    return {"layout": dataclasses.asdict(best.layout), "describe": best.layout.describe(),
            "peak_gib": best.memory.peak / 2**30, "step_s": best.time.total,
            "fitting": len(candidates), "config_rank": ranks[0] if ranks else None}  # fmt: skip


def format_table(candidates, job: Job, calib: Calibration, total: int) -> str:
    lines = [f"{total} layouts fit; calibration: {calib.device}",
             f"{'#':>3} {'layout':<40} {'start GiB':>9} {'peak GiB':>9} {'step s':>9} "
             f"{'tok/s/dev':>10} {'compute':>8} {'comm':>8} {'bubble':>8}"]  # fmt: skip
    for i, c in enumerate(candidates, 1):
        t = c.time
        devices = c.layout.world_size
        rate = job.global_batch * job.seq_len / t.total / devices
        comm = t.tp_comm + t.dp_comm + t.cp_comm + t.pp_comm + t.ep_comm
        lines.append(f"{i:>3} {c.layout.describe():<40} {c.memory.startup / 2**30:>9.2f} "
                     f"{c.memory.peak / 2**30:>9.2f} {t.total:>9.3f} {rate:>10.0f} "
                     f"{t.compute:>8.3f} {comm:>8.3f} {t.bubble:>8.3f}")  # fmt: skip
    return "\n".join(lines)


def parallel_of(layout: Layout):
    """The trainer's `ParallelConfig` of a planner `Layout`."""
    from mindspeed_core.parallel import ParallelConfig

    tp = layout.tp > 1
    return ParallelConfig(tp=layout.tp, pp=layout.pp, pp_schedule=layout.pp_schedule,
                          virtual_stages=layout.virtual_stages, cp=layout.cp, ep=layout.ep,
                          dp_shard=layout.dp_shard, dp_replicate=layout.dp_replicate,
                          sequence_parallel=layout.sequence_parallel and tp,
                          loss_parallel=layout.loss_parallel and tp)  # fmt: skip


def trainer_accepts(config, seq_len: int):
    """The planner's filter: a layout the trainer's own check (`check_layout`) accepts for
    this model, MoE models under pp with each layer's own load-balancing loss (as
    `pretrain_command` sets it; the pooled one needs every layer on one stage)."""
    from mindspeed_llm.models.common.layout import LayoutError, check_layout

    per_layer = dataclasses.replace(config, router_aux_loss_scope="layer")

    def accept(layout: Layout) -> bool:
        model = per_layer if layout.pp > 1 and config.num_experts else config
        try:
            check_layout(model, parallel_of(layout), seq_len=seq_len, recompute=layout.ac != "none")
        except LayoutError:
            return False
        return True

    return accept


def pretrain_command(opts: dict, layout: Layout, per_node: int, moe: bool = False) -> str:
    """The `mindspeed pretrain` command line (under torchrun) that trains with `layout`."""
    model = opts["model"]
    if Path(model).exists():
        source = f"--model.hf_config {model}"
    else:
        family, _, flavor = model.partition(":")
        source = f"--model.family {family} --model.flavor {flavor or 'debug'}"
    nodes = max(opts["devices"] // per_node, 1)
    parts = [f"torchrun --nnodes {nodes} --nproc-per-node {min(per_node, opts['devices'])} "
             f"-m mindspeed_llm.pretrain {source}",
             f"--data.seq_len {opts['seq_len']} --train.global_batch {opts['global_batch']}",
             f"--train.micro_batch {layout.micro_batch} --train.precision {opts['precision']}",
             f"--train.ac {layout.ac}"]  # fmt: skip
    for name in ("tp", "pp", "cp", "ep", "dp_replicate"):
        if getattr(layout, name) > 1:
            parts.append(f"--parallel.{name} {getattr(layout, name)}")
    if layout.tp > 1:
        parts.append("--parallel.sequence_parallel true")
    if moe and layout.pp > 1:  # each stage's layers balanced on their own
        parts.append("--model.router_aux_loss_scope layer")
    if layout.activation_offload or layout.optimizer_offload:  # not wired into pretrain yet
        parts.append(f"# offload: activations={layout.activation_offload} "
                     f"optimizer={layout.optimizer_offload}")  # fmt: skip
    return " ".join(parts)


def _calibration(args, config, job: Job) -> Calibration:
    if args.calibration is not None:
        loaded = cal.load(args.calibration)
        if loaded is None:
            raise ConfigError(f"--calibration {args.calibration} does not exist")
        return loaded
    name = _device_name(job.device)
    if args.calibrate:
        calib = calibrate(config, job, name)
        cal.save(calib, cal.cache_path(name))
        return calib
    return cal.load_cached(cal.cache_path(name)) or Calibration.default(job.device)


def _device_name(device_type: str) -> str:
    from mindspeed_core import device as dev

    here = dev.detect_device_type()
    return f"{device_type}:{dev.device_name(here)}" if here == device_type else f"{device_type}:other"


def calibration_job(config, job: Job):
    """A two-layer copy of the model (vocabulary capped) and a short job to measure with."""
    small = dataclasses.replace(config, num_layers=min(config.num_layers, 2),
                                vocab_size=min(config.vocab_size, 8192))  # fmt: skip
    seq = min(job.seq_len, 256 if job.device == "cpu" else 2048)
    small = dataclasses.replace(small, max_position_embeddings=max(seq, 2 * small.num_layers))
    return small, Job(seq_len=seq, global_batch=8, precision=job.precision, device=job.device)


def calibrate(config, job: Job, name: str, world: int = 2) -> Calibration:
    """Measure this machine (see `mindspeed_core.planning.calibrate`): all-gathers, single-rank
    steps at two micro-batch sizes on `world` ranks at once, one tp and one FSDP run. CPU:
    gloo ranks; an accelerator in one process calibrates compute only."""
    from mindspeed_core.testing import run_distributed
    from mindspeed_llm.models.shape import model_shape

    small, cal_job = calibration_job(config, job)
    shape = model_shape(small)
    calib = Calibration.default(job.device)
    calib.device = name
    single = [Layout(micro_batch=m) for m in (1, 2, 4)]
    if job.device != "cpu":  # one process on this accelerator: compute only
        steps = _step_times(small, single, cal_job)
        cal.fit_compute([(shape, lay, cal_job, t) for lay, t in zip(single, steps, strict=True)], calib)
        return calib
    cal.fit_collectives(run_distributed(_collective_times, world, timeout=600)[0], world, calib)
    # one intra-op thread per rank: ranks share cores only when there are more ranks than cores
    calib.ranks_share_cores = world > (os.cpu_count() or 1)
    steps = _slowest(run_distributed(_step_times, world, small, single, cal_job, True, timeout=1800))
    cal.fit_compute([(shape, lay, cal_job, t) for lay, t in zip(single, steps, strict=True)], calib)
    cal_job = dataclasses.replace(cal_job, global_batch=4 * world)
    parallel = {"fsdp": Layout(dp_shard=world, micro_batch=4),
                "tp": Layout(tp=world, sequence_parallel=True, loss_parallel=True, micro_batch=4)}  # fmt: skip
    if config.num_heads % world or config.num_kv_heads % world:
        del parallel["tp"]
    layouts = list(parallel.values())
    steps = _slowest(run_distributed(_step_times, world, small, layouts, cal_job, timeout=1800))
    for (kind, layout), seconds in zip(parallel.items(), steps, strict=True):
        cal.fit_overhead(kind, shape, layout, cal_job, seconds, calib)
    return calib


def _slowest(per_rank: list[list[float]]) -> list[float]:
    return [max(rank[i] for rank in per_rank) for i in range(len(per_rank[0]))]


def _step_times(config, layouts, job, alone: bool = False, steps: int = 4) -> list[float]:
    """Median step time of each layout (run on every rank); `alone`: each rank runs the
    layout by itself (no process group of its own), all ranks at once."""
    from mindspeed_tools.plan_runner import run_layout

    return [statistics.median(run_layout(config, layout, job, steps=steps, measure_memory=False,
                                         alone=alone)["step_s"])
            for layout in layouts]  # fmt: skip


def _collective_times():
    return cal.time_collectives()


command = Command(help=HELP, run=run)
