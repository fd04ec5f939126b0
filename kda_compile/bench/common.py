"""Shared benchmark plumbing: timing with quantiles, environment columns, CSV and table output."""
from __future__ import annotations


import csv
import importlib
import importlib.metadata
import logging
import pathlib
import shlex
import sys

import torch

logger = logging.getLogger("kda_compile.bench")

QUANTILES = (0.2, 0.5, 0.8)
# One schema for every benchmark's CSV (the runs' and the curated ones in the repository's benchmarks/):
# ``gate`` is the KDA gate form ("softplus", "lower_bound") and empty where it does not apply; ``versions``
# is one string, e.g. "torch 2.11.0+cu130; triton 3.6.0; fla 0.6.0; transformers 5.17.0".
CSV_COLUMNS = ("op", "provider", "mode", "gate", "shape", "metric", "unit", "p20", "p50", "p80",
               "device", "versions", "command")
VERSIONED_PACKAGES = ("torch", "triton", "fla", "transformers", "flash_kda")  # module = label


def _version(module: str) -> str:
    """``module.__version__``, else its distribution's version (FlashKDA has no ``__version__``; its build,
    ``.ci/flashkda_build.sh``, records ``0.0.1+<commit>``); raises when neither is there."""
    found = getattr(importlib.import_module(module), "__version__", None)
    return found if found is not None else importlib.metadata.version(module)


def bench_command(argv: list[str] | None = None) -> str:
    """The command line of this benchmark run as a user would type it, without ``--csv`` (the report
    shows it under the results, so a run limited to some shapes or providers says so)."""
    args = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--csv":
            skip = True
        elif not arg.startswith("--csv="):
            kept.append(shlex.quote(arg))
    return " ".join(["python -m kda_compile.bench", *kept])


def environment() -> dict:
    """The ``device``, ``versions`` and ``command`` columns added to every row (packages not installed are
    left out)."""
    found = []
    for module in VERSIONED_PACKAGES:
        try:
            found.append(f"{module} {_version(module)}")
        except Exception:  # not installed, or broken: the run did not use it
            continue
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "versions": "; ".join(found), "command": bench_command()}


def time_quantiles(fn, *, warmup_ms: int = 25, rep_ms: int = 100) -> tuple[float, float, float]:
    """p20 / p50 / p80 of ``fn`` in milliseconds, timed with CUDA events by triton's do_bench."""
    from triton.testing import do_bench

    return tuple(do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=list(QUANTILES)))


def wall_time_quantiles(fn, *, rep_ms: float = 50.0, min_reps: int = 5, max_reps: int = 100,
                        flush_l2: bool = True, device: str = "cuda") -> tuple[float, float, float]:
    """p20 / p50 / p80 ms of one call of ``fn`` as its caller waits for it: host time (argument checks,
    allocations, launches) plus the kernels and the gaps between them. Like do_bench (CUDA events around
    each call, the L2 cache flushed before it), but the device is synchronised before each start event, so
    the call's host time is inside the interval; do_bench lets it overlap the flush of the call before.
    ``rep_ms`` of calls, at least ``min_reps`` and at most ``max_reps``, after two untimed calls.
    ``device="cpu"`` (smoke runs): a wall clock around each of ``min_reps`` calls."""
    import time

    if device != "cuda":
        fn()
        samples = []
        for _ in range(min_reps):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        times = torch.tensor(samples, dtype=torch.float64)
        return tuple(torch.quantile(times, torch.tensor(QUANTILES, dtype=torch.float64)).tolist())
    cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda") if flush_l2 else None
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    estimate_ms = (time.perf_counter() - start) * 1e3
    reps = max(min_reps, min(max_reps, int(rep_ms / max(estimate_ms, 1e-3))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for begin, end in events:
        if cache is not None:
            cache.zero_()
        torch.cuda.synchronize()
        begin.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = torch.tensor([begin.elapsed_time(end) for begin, end in events], dtype=torch.float64)
    return tuple(torch.quantile(times, torch.tensor(QUANTILES, dtype=torch.float64)).tolist())


def cuda_graph_time(fn, *, rep_ms: int = 200) -> tuple[float, float, float]:
    """p20 / p50 / p80 GPU ms of one call of ``fn`` replayed from a CUDA graph (no host overhead)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (allocations, autotuning) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_quantiles(graph.replay, rep_ms=rep_ms)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32: the accuracy column printed beside every timing."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def row(op, provider, mode, shape, metric, unit, values, *, gate: str = "") -> dict:
    """One long-format CSV row (without the environment columns); ``values`` is (p20, p50, p80)."""
    p20, p50, p80 = values
    return {"op": op, "provider": provider, "mode": mode, "gate": gate, "shape": shape, "metric": metric,
            "unit": unit, "p20": p20, "p50": p50, "p80": p80}


def write_csv(rows: list[dict], path: pathlib.Path) -> None:
    """Write ``rows`` (with their environment columns) as a CSV of ``CSV_COLUMNS``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def named_choices(text: str, allowed, option: str) -> list[str]:
    """The comma-separated names of ``text`` (a command-line option's value), each one of ``allowed``; else exits
    naming ``option`` and what it accepts."""
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise SystemExit(f"{option} must name some of {', '.join(allowed)}, got {text!r}")
    return names


def format_table(headers: list[str], lines: list[list]) -> str:
    """A GitHub-markdown table (floats with 3 decimals, anything else as ``str``)."""
    text = [headers] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in line] for line in lines]
    out = ["| " + " | ".join(text[0]) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(line) + " |" for line in text[1:]]
    return "\n".join(out)


def measure_copy_bandwidth(nbytes: int = 1 << 30) -> tuple[float, float, float]:
    """Device-to-device copy bandwidth in TB/s (bytes read + written), p20/p50/p80."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_quantiles(lambda: dst.copy_(src))
    return tuple(2 * nbytes / (t * 1e-3) / 1e12 for t in reversed(ms))


def kernel_times(fn, *, calls: int = 3, device_type: str = "cuda") -> list[tuple[str, int, float]]:
    """Where one call of ``fn`` spends its device time: ``(kernel name, launches per call, ms per
    call)``, longest first, from torch.profiler over ``calls`` calls (after one unprofiled call).
    ``device_type="cpu"`` aggregates the CPU-side operator events instead (used by the CPU tests)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    if device_type == "cuda":
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] if device_type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if device_type == "cuda":
            torch.cuda.synchronize()
    wanted = torch.autograd.DeviceType.CUDA if device_type == "cuda" else torch.autograd.DeviceType.CPU
    totals: dict[str, list] = {}
    for event in prof.events():
        if event.device_type != wanted:
            continue
        entry = totals.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += (event.device_time if device_type == "cuda" else event.cpu_time) / 1e3
    return sorted(((name, count // calls, ms / calls) for name, (count, ms) in totals.items()),
                  key=lambda item: -item[2])


def host_profile(fn, *, calls: int = 300, top: int = 15) -> str:
    """cProfile of ``calls`` back-to-back calls of ``fn``: the ``top`` functions by own time (where the
    host time of a launch-bound call goes)."""
    import cProfile
    import io
    import pstats

    fn()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()
