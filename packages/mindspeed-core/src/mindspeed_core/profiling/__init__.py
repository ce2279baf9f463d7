"""Step profiling: torch.profiler traces of a window of training steps, and the compute vs
communication vs idle breakdown read back from them (`mindspeed profile RUN_DIR`)."""

from mindspeed_core.profiling.breakdown import (
    find_traces,
    format_table,
    load_trace,
    step_breakdown,
    summarize,
    top_operators,
    write_breakdown,
)
from mindspeed_core.profiling.profiler import ProfileConfig, StepProfiler, build_profiler

__all__ = [
    "ProfileConfig",
    "StepProfiler",
    "build_profiler",
    "find_traces",
    "format_table",
    "load_trace",
    "step_breakdown",
    "summarize",
    "top_operators",
    "write_breakdown",
]
