"""GDN: kda_compile's gated-delta-rule ops against flash-linear-attention's, side by side.

``python -m kda_compile.bench gdn``: ``chunk_gated_delta_rule`` forward in inference mode (``fwd``) and forward +
backward (``fwd+bwd``), and ``fused_recurrent_gated_delta_rule`` for one decode token (``decode``), at
Qwen3-Next's widths: 16 q/k heads, 32 value heads, K = V = 128, bf16 q / k / v, the q / k L2 norm, the GDN gate
(``-exp(A_log) * softplus(a + dt_bias)``) and the beta sigmoid computed inside the op, an fp32 initial state and
the final state returned. Shapes: ``BxT`` (B sequences of T tokens), ``varlen:NxT`` (N sequences of T tokens
packed with ``cu_seqlens``) and ``varlen:a+b+...`` (packed sequences of those lengths, empty ones allowed).

Providers, all with the same math:

- ``ours``: ``kda_compile.ops`` with its automatic backend choice (FLA's GDN kernels when fla-core 0.6 is
  installed, docs/gdn.md);
- ``ours (KDA kernels)``: the same op restricted to the route through the KDA kernels, and there to our own
  Triton kernels (``only_backends("kda_kernels")`` here and KDA's ``only_backends("triton_chunk")`` /
  ``("triton_decode")``): the gate broadcast over K (what training runs without FLA);
- ``ours (decode kernel)``: decode only (not in the default list), the op restricted to our decode kernel with the
  scalar gate (``only_backends("decode_kernel")``): what decode runs without FLA;
- ``FLA``: flash-linear-attention's public functions (skipped, with the reason logged, when not importable);
- ``reference``: our torch reference (``only_backends()``), for CPU smoke runs (``--device cpu``).

Per provider, shape and mode: ``wall_time`` (one call as its caller waits for it, host time included; on CPU,
``time.perf_counter``), on CUDA ``kernel_time`` (summed GPU time of its kernels per call, torch.profiler), and
``rel_error_vs_ours`` of the output; for decode on CUDA also ``gpu_time_cuda_graph`` (one step replayed from a
CUDA graph), ``gpu_time_per_step`` (one of ``DECODE_STEPS_PER_GRAPH`` steps captured back to back in one graph,
each on its own inputs and state: a layer's cost inside a model's decode graph) and ``fraction_of_copy_bandwidth``
(the fp32 state read and written per second at the per-step time, over the measured device-to-device copy
bandwidth, the ``copy_bandwidth`` row). Long-format CSV, the schema of every benchmark (``common.CSV_COLUMNS``).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import time
from dataclasses import dataclass

import torch

from kda_compile.bench.common import (QUANTILES, cuda_graph_time, format_table, kernel_times, measure_copy_bandwidth,
                                      rel_error, row, wall_time_quantiles)

logger = logging.getLogger("kda_compile.bench.gdn")

MODES = ("fwd", "fwd+bwd", "decode", "cold_start")
DEFAULT_MODES = ("fwd", "fwd+bwd", "decode")
PROVIDERS = ("ours", "ours (KDA kernels)", "ours (decode kernel)", "FLA", "reference")
DEFAULT_PROVIDERS = ("ours", "ours (KDA kernels)", "FLA")
DEFAULT_SHAPES = "1x4096,1x16384,1x65536,8x2048,varlen:16x1024,varlen:3000+1+0+517+2048+2626"
DECODE_BATCHES = (1, 64, 256)
DECODE_STEPS_PER_GRAPH = 8  # steps of one decode graph (``gpu_time_per_step``), each on its own inputs and state


@dataclass(frozen=True)
class GDNShape:
    batch: int
    lengths: tuple[int, ...] | None = None  # packed sequence lengths (batch is then 1)
    seq_len: int = 0

    @property
    def name(self) -> str:
        if self.lengths is None:
            return f"{self.batch}x{self.seq_len}"
        return f"varlen:{'+'.join(map(str, self.lengths))}"


def parse_shapes(text: str) -> list[GDNShape]:
    shapes = []
    for item in (part.strip().lower() for part in text.split(",")):
        try:
            if item.startswith("varlen:"):
                body = item[len("varlen:"):]
                if "x" in body:
                    n, t = (int(x) for x in body.split("x"))
                    lengths = (t,) * n
                else:
                    lengths = tuple(int(x) for x in body.split("+"))
                if not lengths or min(lengths) < 0 or sum(lengths) < 1:
                    raise ValueError
                shapes.append(GDNShape(1, lengths, sum(lengths)))
            else:
                b, t = (int(x) for x in item.split("x"))
                if b < 1 or t < 1:
                    raise ValueError
                shapes.append(GDNShape(b, None, t))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"shapes must be BxT, varlen:NxT or varlen:a+b+... items (at least one token), got {item!r}") from None
    return shapes


def _heads(text: str) -> tuple[int, int]:
    try:
        h, hv = (int(x) for x in text.split("/"))
        if h < 1 or hv % h:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"heads must be H/HV with HV a multiple of H, got {text!r}") from None
    return h, hv


def _choices(allowed):
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in allowed]
        if not items or bad or len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"must be distinct items of {', '.join(allowed)}, got {text!r}")
        return items
    return parse


def add_arguments(parser) -> None:
    parser.add_argument("--modes", type=_choices(MODES), default=list(DEFAULT_MODES),
                        help="subset of fwd,fwd+bwd,decode,cold_start (default: the first three; cold_start: the first "
                             "forward and the first decode step of each provider in a fresh process with empty "
                             "kernel caches, on the first --shapes item)")
    parser.add_argument("--providers", type=_choices(PROVIDERS), default=list(DEFAULT_PROVIDERS),
                        help=f"subset of {', '.join(PROVIDERS)} (default: {', '.join(DEFAULT_PROVIDERS)})")
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes(DEFAULT_SHAPES),
                        help=f"prefill shapes (default: {DEFAULT_SHAPES})")
    parser.add_argument("--decode-batches", type=lambda t: [int(x) for x in t.split(",")], default=list(DECODE_BATCHES))
    parser.add_argument("--heads", type=_heads, default=(16, 32), help="H/HV, q/k and value heads (default 16/32)")
    parser.add_argument("--head-dim", type=int, default=128, help="K = V (default 128)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke run (use --providers reference and tiny --shapes)")


def make_inputs(shape: GDNShape, heads: tuple[int, int], dim: int, device: str, dtype=torch.bfloat16, seed=0):
    """One call's keyword arguments as HF's GDN layers make them (raw gate and beta logits, in-kernel options)."""
    H, HV = heads
    gen = torch.Generator().manual_seed(seed)
    B, T = shape.batch, shape.seq_len
    N = B if shape.lengths is None else len(shape.lengths)
    rand = lambda *s: torch.randn(*s, generator=gen).to(device)  # noqa: E731
    args = dict(q=rand(B, T, H, dim).to(dtype), k=rand(B, T, H, dim).to(dtype), v=rand(B, T, HV, dim).to(dtype),
                g=rand(B, T, HV), beta=rand(B, T, HV).to(dtype), A_log=torch.rand(HV, generator=gen).to(device),
                dt_bias=rand(HV), initial_state=rand(N, HV, dim, dim) * 0.1, output_final_state=True,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    if shape.lengths is not None:
        offsets = torch.tensor([0, *torch.tensor(shape.lengths).cumsum(0).tolist()], dtype=torch.int32)
        args.update(cu_seqlens=offsets.to(device))
    return args


def _provider(name: str, decode: bool):
    """``(function, context manager factory)`` for a provider, or ``(None, reason)``."""
    from kda_compile.ops import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from kda_compile.ops.gdn.backends import registry as gdn_backends
    from kda_compile.ops.kda.backends import registry as kda_backends

    ours = fused_recurrent_gated_delta_rule if decode else chunk_gated_delta_rule
    if name == "ours":
        return ours, contextlib.nullcontext
    if name == "reference":
        return ours, gdn_backends.only_backends
    if name == "ours (decode kernel)":
        if not decode:
            return None, "our GDN decode kernel serves decode only"
        return ours, lambda: gdn_backends.only_backends("decode_kernel")
    if name == "ours (KDA kernels)":
        kda_kernel = "triton_decode" if decode else "triton_chunk"

        @contextlib.contextmanager
        def kda_kernels():
            with gdn_backends.only_backends("kda_kernels"), kda_backends.only_backends(kda_kernel):
                yield
        return ours, kda_kernels
    try:
        fla = importlib.import_module("fla.ops.gated_delta_rule")
    except Exception as exc:  # not installed, or broken
        return None, f"fla.ops.gated_delta_rule is not importable ({type(exc).__name__}: {exc})"
    return (fla.fused_recurrent_gated_delta_rule if decode else fla.chunk_gated_delta_rule), contextlib.nullcontext


def _wall(fn, device: str):
    if device == "cuda":
        return wall_time_quantiles(fn)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    q = torch.quantile(torch.tensor(times, dtype=torch.float64), torch.tensor(QUANTILES, dtype=torch.float64))
    return tuple(q.tolist())


def _call(fn, args, mode: str):
    """One timed unit of work: the forward without grad, or forward + backward of a scalar loss."""
    if mode != "fwd+bwd":
        with torch.no_grad():
            return fn(**args)
    leaves = [args[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")]
    o, state = fn(**args)
    torch.autograd.grad(o.float().sum() + state.sum(), leaves)
    return o, state


def op_name(mode: str) -> str:
    """The public function a mode measures (the CSV's ``op``)."""
    return "fused_recurrent_gated_delta_rule" if mode == "decode" else "chunk_gated_delta_rule"


def _decode_graph_rows(op, name, shape_name, fn, args, copy_tbs, rows) -> None:
    """Decode on CUDA, from CUDA graphs (no host time): one step per replay (``gpu_time_cuda_graph``: includes the
    replay's own launch latency, a few microseconds), and ``DECODE_STEPS_PER_GRAPH`` steps on distinct inputs and
    states captured back to back, per step (``gpu_time_per_step``: what the layer's kernel costs inside a model's
    decode graph; every step reads its own state, and the timer flushes the L2 cache between replays). The state
    bytes read and written per second over the measured copy bandwidth, from the per-step time."""
    steps = [args] + [{n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in args.items()}
                      for _ in range(DECODE_STEPS_PER_GRAPH - 1)]

    def all_steps():
        for step in steps:
            _call(fn, step, "decode")
    try:
        graph = cuda_graph_time(lambda: _call(fn, args, "decode"))
        per_step = tuple(t / len(steps) for t in cuda_graph_time(all_steps))
    except Exception as exc:  # a provider that cannot be captured: say so and go on
        logger.warning("%s, decode %s: not captured in a CUDA graph (%s: %s)", name, shape_name, type(exc).__name__,
                       exc)
        return
    rows.append(row(op, name, "decode", shape_name, "gpu_time_cuda_graph", "ms", graph))
    rows.append(row(op, name, "decode", shape_name, "gpu_time_per_step", "ms", per_step))
    state_bytes = 2 * args["initial_state"].numel() * args["initial_state"].element_size()
    fraction = tuple(state_bytes / (ms * 1e-3) / (copy_tbs * 1e12) for ms in reversed(per_step))
    rows.append(row(op, name, "decode", shape_name, "fraction_of_copy_bandwidth", "1", fraction))


def bench_shape(shape_name, args, mode, providers, device, rows, lines, copy_tbs=None):
    op = op_name(mode)
    if mode == "fwd+bwd":
        args = {n: (t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
                for n, t in args.items()}
    reference_out = None
    for name in providers:
        fn, context = _provider(name, mode == "decode")
        if fn is None:
            logger.warning("%s skipped: %s", name, context)
            continue
        with context():
            out, _ = _call(fn, args, mode)
            wall = _wall(lambda: _call(fn, args, mode), device)
            kernel = None
            if device == "cuda":
                kernel = sum(ms for _, _, ms in kernel_times(lambda: _call(fn, args, mode)))
                if mode == "decode":
                    _decode_graph_rows(op, name, shape_name, fn, args, copy_tbs, rows)
        rows.append(row(op, name, mode, shape_name, "wall_time", "ms", wall))
        if kernel is not None:
            rows.append(row(op, name, mode, shape_name, "kernel_time", "ms", (kernel,) * 3))
        error = "-"
        if reference_out is None:
            reference_out = out.detach()
        else:
            error = rel_error(out.detach(), reference_out)
            rows.append(row(op, name, mode, shape_name, "rel_error_vs_ours", "", (error,) * 3))
        lines.append([mode, shape_name, name, wall[1], kernel if kernel is not None else "-", error])


# Runs in a fresh process (cold_start.first_call_seconds): argv = provider, mode, shape, heads, head dim, device.
_COLD_SCRIPT = """
import sys, time
import torch
from kda_compile.bench import gdn
provider, mode, shape, heads, dim, device = sys.argv[1:7]
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
shape = gdn.GDNShape(int(shape), None, 1) if mode == "decode" else gdn.parse_shapes(shape)[0]
args = gdn.make_inputs(shape, gdn._heads(heads), int(dim), device)
fn, context = gdn._provider(provider, mode == "decode")
sync()
start = time.perf_counter()
with context():
    gdn._call(fn, args, mode)
sync()
print(f"FIRST_CALL_S {time.perf_counter() - start:.6f}")
"""


def bench_cold_start(args, rows, lines) -> None:
    """The first forward (first --shapes item) and the first decode step (the first decode batch) of each
    provider, each in a fresh process with empty Triton and NVRTC caches."""
    from kda_compile.bench.cold_start import first_call_seconds
    heads = "/".join(map(str, args.heads))
    for mode, shape in (("fwd", args.shapes[0].name), ("decode", str(args.decode_batches[0]))):
        for provider in args.providers:
            if provider == "reference" or (provider == "ours (decode kernel)" and mode == "fwd"):
                continue
            seconds, status = first_call_seconds(provider, mode, shape, heads, str(args.head_dim), args.device,
                                                 script=_COLD_SCRIPT)
            logger.info("GDN cold start, %s %s, %s: %.1f s (%s)", mode, shape, provider, seconds, status)
            op = op_name(mode)
            label = f"{shape}x1" if mode == "decode" else shape
            rows.append(row(op, provider, "cold_start", label, "first_call_time", "s", (seconds,) * 3))
            lines.append(["cold_start " + mode, label, provider, seconds, "-", status])


def run(args) -> list[dict]:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the GDN benchmark needs a CUDA device (or --device cpu for a smoke run)")
    torch.manual_seed(0)
    rows, lines = [], []
    copy_tbs = None
    if args.device == "cuda" and "decode" in args.modes:
        copy = measure_copy_bandwidth()
        rows.append(row("copy", "torch", "decode", "1 GiB", "copy_bandwidth", "TB/s", copy))
        copy_tbs = copy[1]
    for mode in args.modes:
        if mode == "cold_start":
            bench_cold_start(args, rows, lines)
            continue
        if mode == "decode":
            cases = [(f"{b}x1", GDNShape(b, None, 1)) for b in args.decode_batches]
        else:
            cases = [(s.name, s) for s in args.shapes]
        for name, shape in cases:
            inputs = make_inputs(shape, args.heads, args.head_dim, args.device)
            bench_shape(name, inputs, mode, args.providers, args.device, rows, lines, copy_tbs)
    H, HV = args.heads
    print(f"\nGDN, bf16, H/HV = {H}/{HV}, K = V = {args.head_dim}, in-kernel l2norm / gate / beta, fp32 state in and "
          "out; median wall ms (kernel ms: summed GPU time per call)")
    print(format_table(["mode", "shape", "provider", "wall ms", "kernel ms", "rel error vs first"], lines))
    return rows
