"""A parent for test_lifeline.py: starts a pool of 2 workers with `sys.argv[1]`'s start
method, tied to it by mindspeed_core.lifeline, gives them endless work, prints "ready" and waits
to be killed. argv[2] "slow-import": the initializer's module takes 60 s to import (as a
worker module that imports torch does), and the parent says "ready" while they import."""

import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from mindspeed_core.lifeline import pool_initializer


def spin(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass


if __name__ == "__main__":
    method, mode = sys.argv[1], sys.argv[2]
    target = "lifeline_slow_module:init" if mode == "slow-import" else None
    pool = ProcessPoolExecutor(
        2, mp_context=multiprocessing.get_context(method), initializer=pool_initializer,
        initargs=(os.getpid(), target),
    )  # fmt: skip
    futures = [pool.submit(spin, 600) for _ in range(2)]
    print("ready", flush=True)
    time.sleep(600)
