"""The per-process side of ``python -m kda_compile.bench cp`` (``context_parallel.py``): one process per rank.

``worker(rank, plan, world_size, port)`` joins the process group (NCCL on ``cuda:<rank>``, gloo on CPU), then per
op and token count: rank 0 alone times the plain op on the whole sequence, then each world size ``n`` of the plan
times the context-parallel providers on ranks ``0 .. n - 1`` (the other ranks wait). Rank 0 writes what was
measured to ``plan.result_path`` (JSON) after every token count, so a run that stops early keeps its rows.

Inputs are drawn in blocks of ``BLOCK`` tokens, each from its own seed, so a rank draws its slice alone and every
provider (one process or any slicing) sees the same tokens. Each timed call: the ranks of the group meet at a
gloo barrier, each times the call on the host until its device is done, and the call's time is the maximum over
the ranks (a gloo all-reduce), so a rank that waits for another in the state exchange counts as waiting.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import pathlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kda_compile.bench.common import QUANTILES, rel_error, row

logger = logging.getLogger("kda_compile.bench.cp")

OPS = {"kda": "chunk_kda", "gdn": "chunk_gated_delta_rule"}
KINDS = ("single", "cp", "balanced", "cp-nostate", "fla")
LOWER_BOUND = -5.0
BLOCK = 8192  # tokens drawn per seed
ALIGN = 64  # uneven slices are cut at multiples of the chunk size where the slice is at least one chunk
HOST = "127.0.0.1"
TIMEOUT = datetime.timedelta(minutes=30)  # idle ranks wait at a barrier while rank 0 times one GPU


@dataclass(frozen=True)
class Plan:
    """What every process runs (pickled to the spawned processes)."""

    ops: tuple[str, ...]
    tokens: tuple[int, ...]
    heads: int
    head_dim: int
    world_sizes: tuple[int, ...]
    kinds: tuple[str, ...]
    first_rank_share: float | None
    warmup: int
    reps: int
    device: str
    result_path: str
    seed: int = 0

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device == "cuda" else torch.float32


def provider_name(kind: str, n: int, device: str) -> str:
    """The CSV provider of a kind at world size ``n``: ``ours (1 GPU)``, ``ours (CP, 2 GPUs, balanced)`` ...
    (``process`` instead of ``GPU`` on CPU)."""
    unit = ("GPU", "GPUs") if device == "cuda" else ("process", "processes")
    if kind == "single":
        return f"ours (1 {unit[0]})"
    suffix = {"cp": "", "balanced": ", balanced", "cp-nostate": ", no state", "fla": ", no state"}[kind]
    who = "FLA" if kind == "fla" else "ours"
    return f"{who} (CP, {n} {unit[1]}{suffix})"


def balanced_lengths(tokens: int, n: int, share: float) -> tuple[int, ...]:
    """Slice lengths giving rank 0 ``share`` times the tokens of each other rank (the others' slices cut to
    a multiple of ``ALIGN`` tokens when at least that long; rank 0 takes the rest)."""
    other = int(tokens / (n - 1 + share))
    if other >= ALIGN:
        other -= other % ALIGN
    if other < 1:
        raise ValueError(f"--first-rank-share {share:g}: leaves no token to the other {n - 1} ranks of {tokens} "
                         "tokens; accepted: a share that leaves every rank at least one token")
    return (tokens - (n - 1) * other,) + (other,) * (n - 1)


def make_params(op: str, heads: int, dim: int, device, seed: int) -> dict:
    """The gate parameters and the fp32 initial state ``[1, H, K, V]`` (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    gate_width = heads * dim if op == "kda" else heads
    return {"A_log": torch.rand(heads, generator=gen).to(device),
            "dt_bias": (0.1 * torch.randn(gate_width, generator=gen)).to(device),
            "h0": (0.1 * torch.randn(1, heads, dim, dim, generator=gen)).to(device)}


def make_tokens(op: str, start: int, length: int, heads: int, dim: int, device, dtype, seed: int) -> dict:
    """q, k, v, g, beta ``[1, length, ...]`` of tokens ``[start, start + length)`` of the sequence."""
    tails = {"q": (heads, dim), "k": (heads, dim), "v": (heads, dim),
             "g": (heads, dim) if op == "kda" else (heads,), "beta": (heads,)}
    return {name: _blocks(index, tail, start, length, device, dtype, seed) for index, (name, tail) in
            enumerate(tails.items())}


def _blocks(index: int, tail: tuple, start: int, length: int, device, dtype, seed: int) -> torch.Tensor:
    out = torch.empty(1, length, *tail, device=device, dtype=dtype)
    for block in range(start // BLOCK, (start + length - 1) // BLOCK + 1):
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + index * 100_003 + block)
        values = torch.randn(1, BLOCK, *tail, generator=gen, device=device, dtype=dtype)
        lo, hi = max(start, block * BLOCK), min(start + length, (block + 1) * BLOCK)
        out[:, lo - start:hi - start] = values[:, lo - block * BLOCK:hi - block * BLOCK]
    return out


def call_kwargs(op: str, params: dict, state: bool) -> dict:
    """The keyword arguments shared by every provider: in-kernel q/k norm, gate and beta sigmoid (KDA:
    ``lower_bound=-5`` with ``safe_gate``), with or without the initial and final states."""
    kwargs = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  A_log=params["A_log"], dt_bias=params["dt_bias"], output_final_state=state)
    if state:
        kwargs["initial_state"] = params["h0"]
    if op == "kda":
        kwargs.update(lower_bound=LOWER_BOUND, safe_gate=True)
    return kwargs


def _function(op: str, fla: bool = False):
    if fla:
        os.environ["FLA_FLASH_KDA"] = "0"  # FLA's own kernels (FlashKDA takes no context anyway)
        if op == "kda":
            from fla.ops.kda import chunk_kda
            return chunk_kda
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        return chunk_gated_delta_rule
    from kda_compile.ops import chunk_gated_delta_rule, chunk_kda

    return chunk_kda if op == "kda" else chunk_gated_delta_rule


def time_calls(fn, device: str, warmup: int, reps: int, group=None):
    """``(p20, p50, p80)`` ms of ``fn`` over ``reps`` calls after ``warmup`` untimed ones, and the last result.
    With a (gloo) ``group``: a barrier before each call, and each call's time is the maximum over its ranks."""
    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    result = None
    for _ in range(warmup):
        result = None
        result = fn()
    sync()
    times = []
    for _ in range(reps):
        result = None
        if group is not None:
            dist.barrier(group=group)
        start = time.perf_counter()
        result = fn()
        sync()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        if group is not None:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        times.append(1e3 * elapsed.item())
    quantiles = torch.quantile(torch.tensor(times, dtype=torch.float64), torch.tensor(QUANTILES, dtype=torch.float64))
    return tuple(quantiles.tolist()), result


class Recorder:
    """Rank 0's results: CSV rows, table lines (``[op, shape, provider, p50, speedup, efficiency, error]``)
    and skip reasons, written to the plan's JSON file."""

    def __init__(self, path: str):
        self.path = pathlib.Path(path)
        self.rows, self.lines, self.skipped = [], [], []
        self.single = None  # (p50, final state) of the one-process run of the current op and shape

    def skip(self, op: str, shape: str, provider: str, reason: str) -> None:
        logger.info("skipped: %s, %s, %s: %s", OPS[op], shape, provider, reason)
        self.skipped.append(f"{OPS[op]} {shape} {provider}: {reason}")

    def add(self, op: str, shape: str, provider: str, n: int, quantiles, final=None) -> None:
        gate = "lower_bound" if op == "kda" else ""
        self.rows.append(row(OPS[op], provider, "fwd", shape, "wall_time", "ms", quantiles, gate=gate))
        error = None
        if final is not None and self.single is not None and n > 1:
            error = rel_error(final, self.single[1])
            self.rows.append(row(OPS[op], provider, "fwd", shape, "final_state_rel_error_vs_one_device", "1",
                                 (error,) * 3, gate=gate))
        speedup = self.single[0] / quantiles[1] if self.single is not None else None
        self.lines.append([OPS[op], shape, provider, quantiles[1], speedup, None if speedup is None else speedup / n,
                           error])
        logger.info("%s %s, %s: p50 %.3f ms%s", OPS[op], shape, provider, quantiles[1],
                    "" if speedup is None else f", {speedup:.2f}x the one-process run")

    def write(self) -> None:
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps({"rows": self.rows, "lines": self.lines, "skipped": self.skipped}))
        temporary.replace(self.path)


def worker(rank: int, plan: Plan, world_size: int, port: int) -> None:
    """One rank of the benchmark (``torch.multiprocessing.start_processes`` entry point)."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(levelname)s %(name)s [rank {rank}]: %(message)s")
    if plan.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        device = torch.device("cpu")
    store = dist.TCPStore(HOST, port, None, False, timeout=TIMEOUT)
    dist.init_process_group("nccl" if plan.device == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world_size, timeout=TIMEOUT)
    try:
        control = dist.new_group(backend="gloo")
        groups = {n: (dist.new_group(list(range(n))), dist.new_group(list(range(n)), backend="gloo"))
                  for n in plan.world_sizes}
        recorder = Recorder(plan.result_path) if rank == 0 else None
        for op in plan.ops:
            for tokens in plan.tokens:
                _one_shape(rank, plan, op, tokens, device, groups, control, recorder)
    finally:
        dist.destroy_process_group()


def _one_shape(rank, plan: Plan, op: str, tokens: int, device, groups, control, recorder) -> None:
    shape = f"1x{tokens}x{plan.heads}"
    if rank == 0:
        recorder.single = None
        if "single" in plan.kinds:
            _run_single(plan, op, tokens, shape, device, recorder)
    dist.barrier(group=control)
    for n in plan.world_sizes:
        if rank < n:
            for kind in (k for k in KINDS[1:] if k in plan.kinds):
                _run_cp(rank, plan, op, tokens, shape, n, kind, device, groups[n], recorder)
        dist.barrier(group=control)
    if rank == 0:
        recorder.write()


def _free(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _run_single(plan: Plan, op: str, tokens: int, shape: str, device, recorder: Recorder) -> None:
    """The plain op on the whole sequence in this process; out of memory: logged, no row."""
    name = provider_name("single", 1, plan.device)
    try:
        quantiles, final = _time_single(plan, op, tokens, device)
        reason = None
    except torch.cuda.OutOfMemoryError as exc:
        reason = f"out of memory on one device ({str(exc).splitlines()[0]})"
    _free(device)  # after the handler: the error's frames no longer hold the inputs
    if reason is not None:
        recorder.skip(op, shape, name, reason)
        return
    recorder.single = (quantiles[1], final)
    recorder.add(op, shape, name, 1, quantiles)


def _time_single(plan: Plan, op: str, tokens: int, device):
    """Quantiles of the plain op on all ``tokens`` and its final state (on the host)."""
    x = make_tokens(op, 0, tokens, plan.heads, plan.head_dim, device, plan.dtype, plan.seed)
    kwargs = call_kwargs(op, make_params(op, plan.heads, plan.head_dim, device, plan.seed), state=True)
    cu = torch.tensor([0, tokens], device=device)
    fn = _function(op)

    def call():
        with torch.inference_mode():
            return fn(**x, cu_seqlens=cu, **kwargs)
    quantiles, result = time_calls(call, plan.device, plan.warmup, plan.reps)
    return quantiles, result[1][0].float().cpu()


def _fla_missing(plan: Plan, op: str) -> str | None:
    """Why FLA's context-parallel op cannot run here (None when it can)."""
    if plan.device != "cuda":
        return "FLA's context parallelism runs on NVIDIA GPUs only"
    try:
        _function(op, fla=True)
        import fla.ops.cp  # noqa: F401
    except Exception as exc:  # not installed, or broken
        return f"not installed: import of FLA's {OPS[op]} / fla.ops.cp failed ({type(exc).__name__}: {exc})"
    return None


def _context(plan: Plan, kind: str, tokens: int, n: int, group, device):
    """This rank's context (ours or FLA's) and its slice ``(start, length)``."""
    cu = torch.tensor([0, tokens], device=device)
    if kind == "fla":
        from fla.ops.cp import build_cp_context as fla_build_cp_context

        rank = dist.get_rank(group)
        return fla_build_cp_context(cu, group), (rank * (tokens // n), tokens // n)
    from kda_compile.ops import build_cp_context

    lengths = balanced_lengths(tokens, n, plan.first_rank_share) if kind == "balanced" else None
    ctx = build_cp_context(cu, group, slice_lengths=lengths)
    return ctx, (ctx.start, ctx.local_length)


def _run_cp(rank, plan: Plan, op, tokens, shape, n, kind, device, groups, recorder) -> None:
    """One context-parallel provider on ranks ``0 .. n - 1``; every rank of the group agrees to skip it."""
    nccl_group, gloo_group = groups
    name = provider_name(kind, n, plan.device)
    if kind == "balanced" and plan.first_rank_share is None:
        return
    why = _fla_missing(plan, op) if kind == "fla" else None
    if why is not None:
        if rank == 0:
            recorder.skip(op, shape, name, why)
        return
    state = kind in ("cp", "balanced")
    try:
        call = _cp_call(plan, op, kind, tokens, n, nccl_group, device, state, log=rank == 0)
        call()  # the first call: compiles, and shows whether the provider runs at all
        failure = None
    except Exception as exc:  # a refused argument or layout, or out of memory: skipped on every rank
        logger.warning("%s %s, %s failed on rank %d", OPS[op], shape, name, rank, exc_info=True)
        failure = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        call = None
        _free(device)
    if not _agreed(failure is None, gloo_group):
        if rank == 0:
            recorder.skip(op, shape, name, failure or "failed on another rank (see its log)")
        return
    quantiles, result = time_calls(call, plan.device, max(0, plan.warmup - 1), plan.reps, group=gloo_group)
    final = _last_rank_state(result[1], rank, n, gloo_group, plan) if state else None
    del call, result
    if rank == 0:
        recorder.add(op, shape, name, n, quantiles, final)
    _free(device)


def _cp_call(plan: Plan, op, kind, tokens, n, group, device, state: bool, log: bool):
    """The call of one context-parallel provider on this rank's slice (its inputs drawn here)."""
    ctx, (start, length) = _context(plan, kind, tokens, n, group, device)
    if log:
        logger.info("%s 1x%dx%d, %s: tokens per rank %s", OPS[op], tokens, plan.heads,
                    provider_name(kind, n, plan.device), list(getattr(ctx, "slice_lengths", (length,) * n)))
    x = make_tokens(op, start, length, plan.heads, plan.head_dim, device, plan.dtype, plan.seed)
    kwargs = call_kwargs(op, make_params(op, plan.heads, plan.head_dim, device, plan.seed), state)
    fn = _function(op, fla=kind == "fla")

    def call():
        with torch.inference_mode():
            return fn(**x, cp_context=ctx, **kwargs)
    return call


def _agreed(ok: bool, group) -> bool:
    """Whether ``ok`` holds on every rank of ``group``."""
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _last_rank_state(final, rank: int, n: int, group, plan: Plan) -> torch.Tensor:
    """The sequence's final state (held by the last rank of the group), sent to every rank of the group."""
    shape = (plan.heads, plan.head_dim, plan.head_dim)
    state = final[0].float().cpu() if rank == n - 1 else torch.empty(shape)
    dist.broadcast(state, src=n - 1, group=group)
    return state
