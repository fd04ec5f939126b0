"""Shared benchmark plumbing: timing with quantiles, environment columns, CSV and table output."""
from __future__ import annotations

import csv
import importlib
import logging
import pathlib

import torch

logger = logging.getLogger("kda_compile.bench")

QUANTILES = (0.2, 0.5, 0.8)
CSV_COLUMNS = ("op", "provider", "mode", "shape", "metric", "unit", "p20", "p50", "p80",
               "device", "torch", "triton", "fla")


def environment() -> dict:
    """Device name and library versions, added to every row."""
    def version(module):
        try:
            return importlib.import_module(module).__version__
        except Exception:
            return "absent"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "torch": torch.__version__, "triton": version("triton"), "fla": version("fla")}


def time_quantiles(fn, *, warmup_ms: int = 25, rep_ms: int = 100) -> tuple[float, float, float]:
    """p20 / p50 / p80 of ``fn`` in milliseconds, timed with CUDA events by triton's do_bench."""
    from triton.testing import do_bench

    return tuple(do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=list(QUANTILES)))


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


def row(op, provider, mode, shape, metric, unit, values) -> dict:
    p20, p50, p80 = values
    return {"op": op, "provider": provider, "mode": mode, "shape": shape, "metric": metric, "unit": unit,
            "p20": p20, "p50": p50, "p80": p80}


def write_csv(rows: list[dict], path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def format_table(headers: list[str], lines: list[list]) -> str:
    """A GitHub-markdown table (what docs/benchmarks.md records)."""
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


def experiment_log(filename: str):
    """A ``report(*parts)`` for the experiment scripts in ``results/``: prints the line and appends it to
    ``$OUT/filename`` (the device's output folder; /tmp without OUT), flushed at once so a run cut off by its
    time limit keeps what it measured."""
    import os

    log = open(os.path.join(os.environ.get("OUT", "/tmp"), filename), "w")

    def report(*parts) -> None:
        line = " ".join(str(part) for part in parts)
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    return report
