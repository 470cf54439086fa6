"""Multi-process start-up: call `jax.distributed.initialize` when the environment asks for it.

Single process (the default, and CI) needs nothing. Multi-host runs set either the explicit
SPECJAX_COORDINATOR / SPECJAX_NUM_PROCESSES / SPECJAX_PROCESS_ID variables, or run under a
cluster JAX detects itself (Cloud TPU pods, SLURM) with SPECJAX_DISTRIBUTED=auto.
"""
from __future__ import annotations

import os

import jax

_initialized = False


def _cpu_collectives() -> None:
    # multi-process CPU runs (tests, debugging) need a cross-process collectives backend
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def initialize() -> None:
    global _initialized
    if _initialized:
        return
    coord = os.environ.get("SPECJAX_COORDINATOR")
    if coord or os.environ.get("SPECJAX_DISTRIBUTED") == "auto":
        _cpu_collectives()
    if coord:
        jax.distributed.initialize(
            coordinator_address=coord,
            num_processes=int(os.environ["SPECJAX_NUM_PROCESSES"]),
            process_id=int(os.environ["SPECJAX_PROCESS_ID"]),
        )
        _initialized = True
    elif os.environ.get("SPECJAX_DISTRIBUTED") == "auto":
        jax.distributed.initialize()  # cluster auto-detection (TPU pod, SLURM, Open MPI)
        _initialized = True
