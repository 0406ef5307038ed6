"""Worker side of tests/test_distributed.py: code that runs in each of 2 processes started with
``torch.multiprocessing`` (spawn), joined over gloo on the CPU through qkv's own
:func:`~qkv.training.distributed.init_distributed` (torchrun's environment variables, set here).

Rank 0 writes results to files (tensors put on a multiprocessing queue die with the process that
shared them); a failure is written as ``error.txt`` so the test can show it.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(fn, args: tuple, *, nprocs: int = 2, timeout: float = 240.0) -> None:
    """Run ``fn(rank, nprocs, port, *args)`` in ``nprocs`` spawned processes; a hang past
    ``timeout`` seconds kills them and raises ``TimeoutError`` (never a hung test)."""
    port = free_port()
    context = mp.start_processes(_entry, args=(nprocs, port, fn, args), nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{fn.__name__} did not finish within {timeout} s (a hang in a collective?)")


def _entry(rank: int, world: int, port: int, fn, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    from qkv.training.distributed import init_distributed, shutdown

    ctx = init_distributed("cpu", timeout_minutes=2)
    try:
        fn(ctx, *args)
    except BaseException:
        Path(args[0], f"error-rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        shutdown()


def step_scenario(ctx, out: str, run_dir: str, steps: list[list[list[int]]], strategy: str, name: str) -> None:
    """``Trainer.step`` on explicit batches: process r takes ``steps[k][r]`` at step k."""
    from qkv.runs.translation import resume_run

    trainer = resume_run(run_dir, train_options={"strategy": strategy, "progress": False}, device="cpu", dist=ctx)
    for group in steps:
        trainer.step([trainer.task.make_batch(group[ctx.rank])])
    model = trainer.plain_model()
    if ctx.is_main:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, Path(out, f"{name}.pt"))


def run_scenarios(ctx, out: str, plan: list[tuple]) -> None:
    """Each entry: ``("steps", run_dir, steps, strategy, name)``, ``("train", run_dir, train_options)``,
    ``("finish", run_dir, train_options)`` (trains, then writes the run's weight files as ``run_training``
    does) or ``("copy", run_dir, new_dir)`` (rank 0 copies the folder)."""
    import shutil

    from qkv.runs.translation import resume_run

    for entry in plan:
        if entry[0] == "steps":
            step_scenario(ctx, out, *entry[1:])
        elif entry[0] == "copy":
            if ctx.is_main:
                shutil.copytree(entry[1], entry[2])
        else:
            kind, run_dir, options = entry
            trainer = resume_run(run_dir, train_options={"progress": False, **options}, device="cpu", dist=ctx)
            trainer.train()
            if kind == "finish":
                trainer.finish()
        ctx.barrier()
    if ctx.is_main:
        Path(out, "done").write_text("ok")
