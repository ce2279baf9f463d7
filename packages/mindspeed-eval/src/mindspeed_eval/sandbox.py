"""The code sandbox, kept importable here: it lives in `mindspeed_core.sandbox` so that the
benchmarks here and the RL code reward of mindspeed-align (which may not import each other)
run generated code the same way."""

from mindspeed_core.sandbox import ExecResult, SandboxLimits, run_program

__all__ = ["ExecResult", "SandboxLimits", "run_program"]
