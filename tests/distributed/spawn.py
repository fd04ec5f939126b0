"""Run a test function in several processes joined by one ``torch.distributed`` process group.

``run_in_processes(fn, world_size, *args)`` starts ``world_size`` fresh processes (the ``spawn`` start
method: no forked state from the test runner) and calls ``fn(rank, world_size, *args)`` in each after
``init_process_group``. ``fn`` must be a module-level function (it is pickled by name). An exception in any
process fails the caller with that process's traceback.

Rendezvous: the parent opens a ``TCPStore`` on a port the operating system picks (port 0) and keeps it open
while the children run, so parallel test workers (pytest-xdist) never race for a port. Collectives time out
after ``timeout_s`` (a rank that never joins a collective fails the test instead of hanging it); at 3/4 of it a
rank still running prints its threads' stacks, and a rank that crashes in native code (an abort, a segfault) prints
them as it dies. A rank whose function returned and whose process group was destroyed leaves with ``os._exit(0)``:
the result is decided by then, and the interpreter's teardown of native threads (gloo's, the compiler's) can abort
a process under load ("terminate called without an active exception"), which would fail a test that passed.

gloo runs on CPU tensors; ``backend="nccl"`` gives each rank the GPU of its index (``cuda:<rank>``) and the test
runner's one-config Triton autotuning.
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import sys
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HOST = "127.0.0.1"


def free_store() -> dist.TCPStore:
    """A rendezvous store listening on a port chosen by the OS, owned by the calling process."""
    return dist.TCPStore(HOST, 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)


def run_in_processes(fn: Callable, world_size: int, *args, backend: str = "gloo", timeout_s: float = 120.0,
                     threads_per_process: int = 1) -> None:
    """``fn(rank, world_size, *args)`` in ``world_size`` spawned processes of one process group."""
    store = free_store()
    mp.start_processes(_child, args=(fn, world_size, store.port, backend, timeout_s, threads_per_process, args),
                       nprocs=world_size, join=True, start_method="spawn")


def _child(rank: int, fn: Callable, world_size: int, port: int, backend: str, timeout_s: float, threads: int,
           args: tuple) -> None:
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    if backend == "nccl":
        torch.cuda.set_device(rank)
        # Each rank autotunes as the test runner does: one config per Triton autotuner (tests/conftest.py patches
        # it when imported). Full autotuning of FLA's and our kernels costs minutes per new shape in each rank.
        import conftest  # noqa: F401
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(HOST, port, None, False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    # A rank still running at 3/4 of the collective timeout prints every thread's stack (stderr), so a hang
    # says where it is before the timeout turns it into a failure.
    faulthandler.dump_traceback_later(max(10.0, 0.75 * timeout_s), exit=False)
    faulthandler.enable(all_threads=True)
    try:
        fn(rank, world_size, *args)
    finally:
        faulthandler.cancel_dump_traceback_later()
        dist.destroy_process_group()
    # reached only when fn returned: an exception above is reported by torch.multiprocessing as usual
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
