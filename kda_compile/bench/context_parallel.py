"""Context-parallel prefill: one long sequence split over N GPUs against the whole sequence on one GPU.

``python -m kda_compile.bench cp`` (a machine with 2 or more GPUs): the forward of ``chunk_kda`` (``--ops gdn``:
``chunk_gated_delta_rule``) in inference mode on ONE sequence (B = 1, ``cu_seqlens = [0, T]``) of T = 128k, 256k,
512k and 1M tokens (``--tokens``), bf16 q / k / v / g, ``--heads`` 16, K = V = 128, the q / k L2 norm, the gate
(KDA: lower bound -5 with ``safe_gate``; GDN: its scalar gate per head) and the beta sigmoid computed inside the
op, an fp32 initial state and the final state returned. Providers:

- ``ours (1 GPU)``: the plain op on the whole sequence on one GPU (out of memory: no row, the reason logged);
- ``ours (CP, N GPUs)``: ``cp_context=build_cp_context(cu_seqlens, group)``, each of N ranks holding T / N
  tokens, for each N of ``--world-sizes`` (default 2 and every power of two up to the GPUs present);
- ``ours (CP, N GPUs, balanced)``: rank 0 holds ``--first-rank-share`` (default 2) times the tokens of each other
  rank (``slice_lengths``; docs/context-parallel.md section 3: every rank but the first pays for the carried state);
- ``ours (CP, N GPUs, no state)`` and ``FLA (CP, N GPUs, no state)``: ours and fla-core 0.6's context-parallel
  op (``fla.ops.cp.build_cp_context``) without initial and final state, which FLA refuses with a context; skipped
  with the reason logged where FLA is not importable (always on CPU).

Each provider: one process per GPU (spawned; NCCL for the state exchange, gloo for the timing), ``--warmup``
untimed calls (the first compiles the kernels), then ``--reps`` calls, each after a barrier of its ranks, timed on
the host until the device is done; a call's time is the maximum over its ranks. CSV metrics ``wall_time`` (ms;
p20 / p50 / p80 over the calls) and ``final_state_rel_error_vs_one_device`` (the CP final state against the
one-GPU run's: the same tokens, drawn per block of tokens from fixed seeds).
The printed table adds the speedup over one GPU and the parallel efficiency (speedup / N).
``--device cpu``: gloo processes, float32, tiny defaults (T = 512, 2 heads, K = V = 16): a smoke run.
"""
from __future__ import annotations

import argparse
import logging
import pathlib
import tempfile

import torch

from kda_compile.bench.common import environment, format_table, write_csv
from kda_compile.bench.cp_worker import KINDS, OPS, Plan, balanced_lengths

logger = logging.getLogger("kda_compile.bench.cp")

TOKENS = {"cuda": (131072, 262144, 524288, 1048576), "cpu": (512,)}
HEADS = {"cuda": 16, "cpu": 2}
HEAD_DIM = {"cuda": 128, "cpu": 16}
DEFAULT_SHARE = 2.0
TABLE_HEADERS = ["op", "shape", "provider", "wall ms (p50)", "speedup vs 1", "efficiency", "final state rel. err"]


def _positive_ints(option: str):
    def parse(text: str) -> list[int]:
        items = [t.strip() for t in text.split(",")]
        if not all(t.isdigit() and int(t) > 0 for t in items) or len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"{option} must be distinct positive integers separated by commas, "
                                             f"got {text!r}")
        return [int(t) for t in items]
    return parse


def _positive(option: str):
    def parse(text: str) -> int:
        if not text.strip().isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"{option} must be a positive integer, got {text!r}")
        return int(text)
    return parse


def _world_sizes(text: str) -> list[int]:
    sizes = _positive_ints("--world-sizes")(text)
    if min(sizes) < 2:
        raise argparse.ArgumentTypeError(f"--world-sizes must be 2 or more processes each (the one-device run is "
                                         f"always measured), got {text!r}")
    return sorted(sizes)


def _items(option: str, allowed):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",")]
        if not items or any(t not in allowed for t in items) or len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"{option} must be distinct items of {','.join(allowed)}, got {text!r}")
        return [t for t in allowed if t in items]
    return parse


def _share(text: str) -> float | None:
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"--first-rank-share must be a positive number (rank 0's tokens over each "
                                         f"other rank's) or none (no balanced run), got {text!r}")
    return value


def add_arguments(parser) -> None:
    parser.add_argument("--ops", "--op", type=_items("--ops", tuple(OPS)), default=["kda"],
                        help="comma-separated subset of kda,gdn (default: kda)")
    parser.add_argument("--tokens", type=_positive_ints("--tokens"), default=None,
                        help="sequence lengths T, comma-separated (default: 131072,262144,524288,1048576; "
                             "with --device cpu: 512)")
    parser.add_argument("--heads", type=_positive("--heads"), default=None,
                        help="heads H (q, k and v alike; default 16, with --device cpu 2)")
    parser.add_argument("--head-dim", type=_positive("--head-dim"), default=None,
                        help="K = V (default 128, with --device cpu 16)")
    parser.add_argument("--world-sizes", type=_world_sizes, default=None,
                        help="context-parallel process counts, comma-separated (default: 2 and every power of two "
                             "up to the GPUs present; with --device cpu: 2)")
    parser.add_argument("--first-rank-share", type=_share, default=DEFAULT_SHARE,
                        help="the balanced slices: rank 0's tokens as a multiple of each other rank's (default: "
                             "%(default)s); none: equal slices only")
    parser.add_argument("--providers", type=_items("--providers", KINDS), default=list(KINDS),
                        help="comma-separated subset of single (one device), cp (equal slices), balanced, "
                             "cp-nostate (ours without states), fla (FLA's, without states) (default: all)")
    parser.add_argument("--warmup", type=_positive("--warmup"), default=2,
                        help="untimed calls per provider and shape (default: 2)")
    parser.add_argument("--reps", type=_positive("--reps"), default=10,
                        help="timed calls per provider and shape (default: 10)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: gloo processes, float32, tiny defaults (a smoke run)")


def default_world_sizes(device_count: int) -> list[int]:
    """2, then every power of two up to ``device_count``."""
    sizes, n = [2], 4
    while n <= device_count:
        sizes.append(n)
        n *= 2
    return sizes


def check_layout(tokens: list[int], world_sizes: list[int], share: float | None) -> None:
    """Every T splits into equal slices at every world size (and into the balanced ones); ValueError naming
    the option otherwise."""
    for t in tokens:
        for n in world_sizes:
            if t < n:
                raise ValueError(f"--tokens {t}: fewer tokens than the {n} ranks of --world-sizes {n}; accepted: "
                                 "at least one token per rank")
            if t % n:
                raise ValueError(f"--tokens {t}: not divisible by --world-sizes {n} (equal slices need T a multiple "
                                 "of every world size)")
            if share is not None:
                balanced_lengths(t, n, share)


def make_plan(args, device_count: int, result_path: str) -> Plan:
    """The checked plan of a run (ValueError naming the option when an option does not fit)."""
    device = args.device
    tokens = args.tokens or list(TOKENS[device])
    world_sizes = args.world_sizes or (default_world_sizes(device_count) if device == "cuda" else [2])
    if device == "cuda" and device_count < 2:
        raise ValueError(f"--world-sizes {','.join(map(str, world_sizes))}: context parallelism needs 2 or more "
                         f"GPUs, {device_count} present")
    if device == "cuda" and max(world_sizes) > device_count:
        raise ValueError(f"--world-sizes {','.join(map(str, world_sizes))}: larger than the {device_count} GPU(s) "
                         f"present; accepted: 2 to {device_count} (one process per GPU)")
    check_layout(tokens, world_sizes, args.first_rank_share if "balanced" in args.providers else None)
    return Plan(ops=tuple(args.ops), tokens=tuple(tokens),
                heads=args.heads or HEADS[device], head_dim=args.head_dim or HEAD_DIM[device],
                world_sizes=tuple(world_sizes), kinds=tuple(args.providers), first_rank_share=args.first_rank_share,
                warmup=args.warmup, reps=args.reps, device=device,
                result_path=result_path)


def spawn(plan: Plan) -> None:
    """Run ``cp_worker.worker`` in ``max(plan.world_sizes)`` spawned processes of one process group."""
    import datetime

    import torch.distributed as dist
    import torch.multiprocessing as mp

    from kda_compile.bench import cp_worker

    store = dist.TCPStore(cp_worker.HOST, 0, None, True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    world_size = max(plan.world_sizes)
    mp.start_processes(cp_worker.worker, args=(plan, world_size, store.port), nprocs=world_size, join=True,
                       start_method="spawn")


def _read_results(path: pathlib.Path) -> dict:
    import json

    if not path.exists():
        return {"rows": [], "lines": [], "skipped": []}
    return json.loads(path.read_text())


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_table(plan: Plan, lines: list[list]) -> None:
    """The table of medians with the speedup over one device and the parallel efficiency."""
    unit = "GPU" if plan.device == "cuda" else "process"
    dtype = "bf16" if plan.device == "cuda" else "float32"
    print(f"\nContext-parallel prefill forward (inference), one sequence, {dtype}, H = {plan.heads}, K = V = "
          f"{plan.head_dim}, in-kernel l2norm / gate / beta; median ms over {plan.reps} calls (a call: the slowest "
          f"rank); speedup = one {unit} / CP, efficiency = speedup / N")
    table = [[op, shape, provider, ms, _cell(speedup, ".2f"), _cell(efficiency, ".0%"), _cell(error, ".1e")]
             for op, shape, provider, ms, speedup, efficiency, error in lines]
    print(format_table(TABLE_HEADERS, table))


def run(args) -> list[dict]:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the context-parallel benchmark needs CUDA devices (or --device cpu for a smoke run)")
    with tempfile.TemporaryDirectory(prefix="kda_cp_bench_") as folder:
        result_path = pathlib.Path(folder) / "results.json"
        try:
            plan = make_plan(args, torch.cuda.device_count() if args.device == "cuda" else 0, str(result_path))
        except ValueError as exc:
            raise SystemExit(f"cp: {exc}") from None
        logger.info("context-parallel benchmark: ops %s, tokens %s, world sizes %s, providers %s",
                    ",".join(plan.ops), ",".join(map(str, plan.tokens)), ",".join(map(str, plan.world_sizes)),
                    ",".join(plan.kinds))
        failure = None
        try:
            spawn(plan)
        except Exception as exc:  # a process failed: keep what rank 0 recorded before
            failure = exc
        results = _read_results(result_path)
    if results["skipped"]:
        logger.info("%d provider(s) skipped (reasons above): %s", len(results["skipped"]),
                    "; ".join(results["skipped"]))
    print_table(plan, results["lines"])
    rows = results["rows"]
    if failure is not None:
        write_csv([{**r, **environment()} for r in rows], args.csv)
        raise SystemExit(f"cp: a benchmark process failed ({type(failure).__name__}: {failure}); the {len(rows)} "
                         f"rows measured before are in {args.csv}")
    return rows
