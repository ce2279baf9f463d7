"""`mindspeed profile RUN_DIR`: print the compute / communication / idle table of a profiled run.

    mindspeed profile runs/pretrain            # every rank's newest trace under the run
    mindspeed profile runs/pretrain --json     # the same as JSON
    mindspeed profile runs/pretrain --top 20   # more operators per rank

The traces are those a training command writes with `--profile.steps A:B` (see
`mindspeed_core.profiling`); `tensorboard --logdir RUN_DIR/tb` shows them too.
"""

from __future__ import annotations

import json
from pathlib import Path

from mindspeed_core.cli import ArgumentParser, Command
from mindspeed_core.errors import ConfigError, DataError
from mindspeed_core.profiling import find_traces, format_table, summarize

HELP = "print compute vs communication vs idle time per rank from a profiled run's traces"


def run(argv: list[str]) -> int:
    parser = ArgumentParser(prog="mindspeed profile", description=HELP)
    parser.add_argument("run_dir", type=Path, help="a run directory (or a folder of traces)")
    parser.add_argument("--top", type=int, default=10, help="operators listed per rank")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.top < 0:  # a negative slice would list all operators but the last
        raise ConfigError(f"--top must be >= 0, got {args.top}")
    if not args.run_dir.is_dir():
        raise DataError(f"{args.run_dir} is not a directory")
    traces = find_traces(args.run_dir)
    if not traces:
        raise DataError(
            f"no *.pt.trace.json under {args.run_dir}; train with --profile.steps A:B first"
        )
    summaries = [summarize(t, args.top) for t in traces]
    print(json.dumps(summaries, indent=1) if args.json else format_table(summaries))
    return 0


command = Command(help=HELP, run=run)
