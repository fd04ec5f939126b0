"""KDA: kda_compile's ops against flash-linear-attention's and FlashKDA's public functions, side by side.

``--modes prefill`` (the default): the forward of ``chunk_kda`` in inference mode for the
lower-bound and the softplus gate, the latter also with strong decays (``--gates``; ``kda_providers.GATES``),
providers ``ours`` (the op as it chooses), ``FLA`` and
``FlashKDA`` (lower-bound gate only; skipped with the reason logged when ``import flash_kda`` fails), the same
math for all (``kda_providers.py``), on 7 batched and 8 packed-varlen shapes (``kda_providers.issue_shapes``).
Per provider, shape and gate: ``wall_time`` (one call as its caller waits for it, host time included:
``common.wall_time_quantiles``), ``kernel_time`` (the summed GPU time of its kernels per call, torch.profiler)
and ``launches`` (kernels per call), timed in ``--rounds`` interleaved rounds; FLA's and FlashKDA's
``rel_error_vs_ours`` (output) and ``final_state_rel_error_vs_ours``. CSV mode ``fwd``.

The older modes (``fwd``, ``fwd+bwd``, ``decode``; softplus gate unless ``--gate`` / ``--gates`` say otherwise;
batched shapes only) measure our own kernels and our FLA path against FLA.
Prefill (``chunk_kda``): forward in inference mode and forward+backward, bf16, K = V = 128, the
in-kernel q/k L2 norm, gate and beta sigmoid, an fp32 initial state, on the shapes of the project's
anchors (B x T x H) plus one 64k-token sequence with 16 heads. Three providers: "ours (own kernels)"
(our Triton prefill, ``only_backends("triton_chunk")``: the op's default for the lower-bound gate with
``lower_bound >= -5`` and, with bf16 and K = V = 128, for every in-kernel gate; else opt-in), "ours (FLA
path)" (the op's default on CUDA for other gates,
``only_backends("fla")``: FLA's gate and intra-chunk kernels, then our scan kernel; FLA's backward) and
"FLA" (its public ``chunk_kda``). Besides the CSV, a PNG plots the speedup over FLA per shape (needs
matplotlib; otherwise the log says why there is none). The providers of a shape are timed in
``--rounds`` interleaved rounds, each quantile the median over the rounds.
``KDA_COMPILE_PREFILL_SEGMENTS=P`` forces the scan's segment count (tuning).
Decode (``fused_recurrent_kda``): one token, 32 heads, fp32 state, batch
1 / 64 / 256, with the state bytes moved per second. GPU time two ways, both from CUDA graphs: one call
per graph replay (``gpu_time``: includes the replay's own launch latency, a few microseconds), and
``DECODE_STEPS_PER_GRAPH`` calls on distinct inputs and states captured back to back, per call
(``gpu_time_per_step``: what each layer's kernel costs inside a model's decode graph; every step reads
its own state and the timer flushes the L2 cache between replays, so no step finds its state cached).
The state bandwidth and its fraction of the copy bandwidth are computed from the latter. Each shape
also records the relative error of our output against FLA's.
``--profile`` adds where the time goes: per prefill shape, mode and provider the GPU time of every
kernel (torch.profiler; CSV metric ``kernel_time: <kernel>``, and a table per shape in the log), and
per decode batch and provider the host functions by own time (cProfile, in the log).
"""
from __future__ import annotations

import logging

import torch

from kda_compile.bench import kda_providers
from kda_compile.bench.common import (cuda_graph_time, environment, format_table, host_profile,
                                      measure_copy_bandwidth, rel_error, row, time_quantiles, write_csv)
from kda_compile.bench.kda_providers import COMPARISON_ROUNDS, GATES, Shape, parse_shapes

logger = logging.getLogger("kda_compile.bench.kda")

PREFILL_SHAPES = [Shape(*s) for s in (  # (B, T, H): anchors.md (H100 table, then the H200 FLA-vs-FlashKDA table)
    (1, 8192, 32), (8, 4096, 32), (1, 32768, 32),
    (8, 1024, 32), (1, 8192, 64), (8, 1024, 64), (1, 8192, 96), (8, 1024, 96), (16, 2048, 32),
    (1, 65536, 16),  # one long sequence with few heads: the case the segmented scan is for
)]
MODES = ("prefill", "fwd", "fwd+bwd", "decode", "cold_start")
PREFILL_PROVIDERS = ("ours (own kernels)", "ours (FLA path)", "FLA")
PREFILL_TARGET = 1.7  # the goal: inference forward at least 1.7x FLA on every benchmark shape
PREFILL_ROUNDS = 3  # interleaved timing rounds per shape and mode (_interleaved_quantiles)
DECODE_BATCHES = (1, 64, 256)
DECODE_STEPS_PER_GRAPH = 8
K = V = 128


def add_arguments(parser) -> None:
    parser.add_argument("--modes", type=_modes, default=["prefill"],
                        help="comma-separated subset of prefill,fwd,fwd+bwd,decode,cold_start (default: prefill, "
                             "the ours / FLA / FlashKDA comparison; cold_start: the first call of each gate and "
                             "provider in a fresh process with an empty Triton cache, on the first shape)")
    parser.add_argument("--gates", type=_gates, default=None,
                        help="comma-separated gate forms, lower_bound (-5, safe_gate: FlashKDA's) and softplus; "
                             "default: both for prefill, softplus for fwd / fwd+bwd / decode")
    parser.add_argument("--gate", choices=GATES, default=None, help="one gate form (the same as --gates GATE)")
    parser.add_argument("--rounds", type=_positive, default=COMPARISON_ROUNDS,
                        help="interleaved timing rounds per shape (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="first two prefill shapes and batch 1/64 only")
    parser.add_argument("--smoke", action="store_true",
                        help="the prefill comparison on a CPU at tiny shapes, ours only: checks the wiring, not the "
                             "speed")
    parser.add_argument("--shapes", type=prefill_shapes, default=None,
                        help=f"prefill shapes, comma-separated: {kda_providers.SHAPES_HELP} (default: the 15 "
                             "comparison shapes for prefill, the anchor shapes for fwd / fwd+bwd, which skip "
                             "varlen ones), e.g. to split a run that would not fit a device's time limit")
    parser.add_argument("--providers", type=_providers_arg, default=list(kda_providers.PROVIDERS),
                        help="comma-separated providers of the prefill comparison and cold start, of "
                             f"{','.join(kda_providers.PROVIDERS)} (default: all; ours always runs: the others "
                             "are checked against it), e.g. to leave out FLA's autotuning at new head counts")
    parser.add_argument("--profile", action="store_true",
                        help="also record each kernel's GPU time per prefill call (torch.profiler) and the host "
                             "functions of each decode call (cProfile)")


def _split(text: str, allowed, what: str) -> list[str]:
    import argparse

    items = [t.strip() for t in text.split(",")]
    bad = [t for t in items if t not in allowed]
    if bad or len(set(items)) != len(items):
        raise argparse.ArgumentTypeError(f"{what} must be distinct items of {','.join(allowed)}, got {text!r}")
    return items


def _modes(text: str) -> list[str]:
    return _split(text, MODES, "modes")


def _gates(text: str) -> list[str]:
    return _split(text, GATES, "gates")


def _providers_arg(text: str) -> list[str]:
    import argparse

    providers = _split(text, kda_providers.PROVIDERS, "providers")
    if "ours" not in providers:
        raise argparse.ArgumentTypeError(f"providers must include ours (the others are checked against it), got {text!r}")
    return providers


def _positive(text: str) -> int:
    import argparse

    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def resolve_gates(args) -> list[str]:
    """The gates to run: ``--gates``, else ``--gate``, else both for prefill / cold start and softplus otherwise."""
    if args.gates is not None and args.gate is not None:
        raise SystemExit("give --gates or --gate, not both")
    if args.gates is not None:
        return args.gates
    if args.gate is not None:
        return [args.gate]
    return list(GATES) if {"prefill", "cold_start"} & set(args.modes) else ["softplus"]


def prefill_shapes(text: str) -> list[Shape]:
    """The ``--shapes`` option: ``kda_providers.parse_shapes``."""
    return parse_shapes(text)


def _providers():
    from fla.ops.kda import chunk_kda as fla_chunk, fused_recurrent_kda as fla_recurrent

    from kda_compile.ops import chunk_kda, fused_recurrent_kda

    return {"fla": (fla_chunk, fla_recurrent), "kda_compile": (chunk_kda, fused_recurrent_kda)}


def _gate_kwargs(gate: str, H: int, device) -> dict:
    kwargs = {"A_log": torch.rand(H, device=device), "dt_bias": torch.randn(H * K, device=device) * 0.1}
    if gate == "softplus_strong":
        kwargs["A_log"] = kda_providers.strong_a_log(kwargs["A_log"])
    if gate == "lower_bound":
        kwargs.update(lower_bound=-5.0, safe_gate=True)
    return kwargs


def _prefill_inputs(B, T, H, device, requires_grad):
    dt = torch.bfloat16
    make = lambda *s: torch.randn(*s, device=device, dtype=dt).requires_grad_(requires_grad)  # noqa: E731
    return dict(q=make(B, T, H, K), k=make(B, T, H, K), v=make(B, T, H, V), g=make(B, T, H, K), beta=make(B, T, H),
                initial_state=torch.randn(B, H, K, V, device=device) * 0.1)


def _prefill_providers():
    """name -> (chunk_kda function, context factory) for the prefill providers."""
    import contextlib

    from fla.ops.kda import chunk_kda as fla_chunk

    from kda_compile.ops import chunk_kda
    from kda_compile.ops.kda.backends.registry import only_backends

    return {
        # our kernels: the default for the bounded lower-bound gate, opt-in otherwise; the backward is FLA's
        "ours (own kernels)": (chunk_kda, lambda: only_backends("triton_chunk")),
        "ours (FLA path)": (chunk_kda, lambda: only_backends("fla")),
        "FLA": (fla_chunk, contextlib.nullcontext),
    }


def _log_prefill_backend(device) -> None:
    """Say which backend "ours (own kernels)" runs on (a fallback would make the row meaningless)."""
    from kda_compile.ops.kda.backends.registry import KDAOptions, only_backends, select_backend

    with only_backends("triton_chunk"):
        chosen = select_backend("chunk_kda", torch.device(device), torch.bfloat16, K, V, KDAOptions(scale=K ** -0.5))
    if chosen.name != "triton_chunk":
        logger.warning("ours (own kernels) runs on the %s backend, not triton_chunk (see the fallback log)", chosen.name)
    else:
        logger.info("ours (own kernels) runs on the triton_chunk backend")


def _bench_prefill(gate, modes, shapes, device, rows, checkpoint=lambda: None, profile=False,
                   rounds=PREFILL_ROUNDS) -> list[list]:
    """Time every prefill provider on every shape and mode; returns the table lines. ``checkpoint``
    runs after each shape (the CLI writes the CSV so far: a run cut off by a time limit keeps it);
    ``profile`` adds each provider's per-kernel GPU times (``kda_providers.record_kernel_times``). Batched
    shapes only."""
    if not any(m in ("fwd", "fwd+bwd") for m in modes):
        return []
    providers = _prefill_providers()
    _log_prefill_backend(device)
    table = []
    for item in shapes:
        if item.varlen:
            logger.warning("fwd / fwd+bwd modes: varlen shape %s skipped (batched shapes only)", item.label)
            continue
        B, T, H = item.B, item.T, item.H
        shape = item.label
        common = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                      **_gate_kwargs(gate, H, device))
        for mode in [m for m in modes if m in ("fwd", "fwd+bwd")]:
            inputs = _prefill_inputs(B, T, H, device, requires_grad=(mode == "fwd+bwd"))
            do = torch.randn(B, T, H, V, device=device, dtype=torch.bfloat16)
            outputs, fns = {}, {}
            for name, (chunk, context) in providers.items():
                if mode == "fwd":
                    def fn(chunk=chunk, context=context):
                        with torch.inference_mode(), context():
                            return chunk(**inputs, **common)[0]
                else:
                    def fn(chunk=chunk, context=context):
                        with context():  # the backward too: it must run on the same backend
                            o = chunk(**inputs, **common)[0]
                            o.backward(do)
                        return o
                outputs[name] = fn().detach()  # also compiles and autotunes before timing
                fns[name] = fn
            results = _interleaved_quantiles(fns, rounds)
            for name, fn in fns.items():
                rows.append(row("chunk_kda", name, mode, shape, "time", "ms", results[name], gate=gate))
                if profile:
                    kda_providers.record_kernel_times(fn, name, mode, shape, gate, rows)
            torch.cuda.empty_cache()
            errors = {}
            for name in PREFILL_PROVIDERS[:2]:
                errors[name] = rel_error(outputs[name], outputs["FLA"])
                rows.append(row("chunk_kda", name, mode, shape, "rel_err_vs_fla", "1", (errors[name],) * 3, gate=gate))
            fla_ms, own_ms, path_ms = (results[n][1] for n in ("FLA", "ours (own kernels)", "ours (FLA path)"))
            table.append([mode, shape, fla_ms, path_ms, own_ms, fla_ms / path_ms, fla_ms / own_ms,
                          f"{errors['ours (own kernels)']:.1e}"])
            logger.info("%s %s: FLA %.3f ms, ours (FLA path) %.3f ms, ours (own kernels) %.3f ms",
                        mode, shape, fla_ms, path_ms, own_ms)
            checkpoint()
    return table


def _interleaved_quantiles(fns: dict, rounds: int = PREFILL_ROUNDS) -> dict:
    """p20 / p50 / p80 ms per provider, each the median over ``rounds`` rounds in which the providers take
    turns: a slow spell of the machine during the run (on one H100 the first shape of a run measured one
    provider 1.4x slower than every later run did) falls on all of them alike, or on one round only."""
    import statistics

    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(time_quantiles(fn))
    return {name: tuple(statistics.median(q) for q in zip(*values)) for name, values in samples.items()}


PREFILL_HEADERS = ["mode", "B x T x H", "FLA", "ours (FLA path)", "ours (own kernels)", "FLA / FLA path",
                   "FLA / own", "own rel. err vs FLA"]


def _plot_prefill_speedup(table: list[list], path) -> None:
    """A PNG of the speedup over FLA per shape (one panel per mode, one bar per provider of ours)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        logger.warning("no prefill speedup PNG: matplotlib is not importable (%s); pip install \"kda-compile[bench]\"", exc)
        return
    modes = [m for m in ("fwd", "fwd+bwd") if any(line[0] == m for line in table)]
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 3.6 * len(modes)), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        lines = [line for line in table if line[0] == mode]
        x = range(len(lines))
        for offset, (label, col) in zip((-0.2, 0.2), (("ours (FLA path)", 5), ("ours (own kernels)", 6))):
            ax.bar([i + offset for i in x], [line[col] for line in lines], width=0.4, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        if mode == "fwd":
            ax.axhline(PREFILL_TARGET, color="red", linestyle="--", linewidth=0.8, label=f"target {PREFILL_TARGET}x")
        ax.set_xticks(list(x), [line[1] for line in lines], rotation=20)
        ax.set_ylabel("speedup over FLA")
        ax.set_title(f"KDA prefill {'forward (inference)' if mode == 'fwd' else 'forward + backward'}, "
                     f"bf16, K = V = {K}")
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    logger.info("prefill speedup plot written to %s", path)


def _host_times_per_call(fns: dict, calls: int = 500, repetitions: int = 7) -> dict:
    """Wall-clock ms per eager call over back-to-back calls (launch-bound decode: this is what a
    serving loop without CUDA graphs sees), p20/p50/p80 over the repetitions, per provider. The
    providers take turns within each repetition, so a drift of the host's speed during the run (it moved
    FLA's batch-1 figure from 0.09 to 0.14 ms between runs) falls on all of them alike."""
    import time

    samples = {name: [] for name in fns}
    for _ in range(repetitions):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            samples[name].append((time.perf_counter() - start) / calls * 1e3)
    result = {}
    for name, values in samples.items():
        values.sort()
        n = len(values)
        result[name] = (values[n // 5], values[n // 2], values[min(n - 1, (4 * n) // 5)])
    return result


def _bench_decode(providers, gate, batches, device, rows, table, profile=False):
    H = 32
    copy_bw = measure_copy_bandwidth()
    rows.append(row("copy", "torch", "decode", "1 GiB", "copy_bandwidth", "TB/s", copy_bw))
    for B in batches:
        shape = f"{B}x1x{H}"
        dt = torch.bfloat16
        make = lambda *s: torch.randn(*s, device=device, dtype=dt)  # noqa: E731
        step = dict(q=make(B, 1, H, K), k=make(B, 1, H, K), v=make(B, 1, H, V), g=make(B, 1, H, K),
                    beta=make(B, 1, H), initial_state=torch.randn(B, H, K, V, device=device) * 0.1)
        common = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True, **_gate_kwargs(gate, H, device))
        common.pop("safe_gate", None)  # not an argument of fused_recurrent_kda
        state_bytes = 2 * B * H * K * V * 4  # fp32 state read + written
        from kda_compile.ops.kda.backends.registry import only_backends

        def fla_path(recurrent=providers["kda_compile"][1], **kwargs):  # our op, forced onto FLA's kernel
            with only_backends("fla"):
                return recurrent(**kwargs)

        # "ours (triton_decode)": the public op as it chooses (our fused Triton decode kernel on CUDA).
        decode = {"fla": providers["fla"][1], "ours (triton_decode)": providers["kda_compile"][1],
                  "ours (fla path)": fla_path}
        # distinct inputs and states for the steps of one graph (the first is `step`)
        steps = [step] + [{n: t.clone() for n, t in step.items()} for _ in range(DECODE_STEPS_PER_GRAPH - 1)]
        gpu, bandwidth, outputs, eager = {}, {}, {}, {}
        for name, recurrent in decode.items():
            def fn(recurrent=recurrent):
                with torch.inference_mode():
                    return recurrent(**step, **common)

            def fn_steps(recurrent=recurrent):
                with torch.inference_mode():
                    for inputs in steps:
                        recurrent(**inputs, **common)
            outputs[name] = fn()[1]
            eager[name] = fn
            if profile:
                logger.info("decode %s, %s: host functions by own time\n%s", shape, name, host_profile(fn))
            one_call = cuda_graph_time(fn)
            gpu[name] = tuple(t / len(steps) for t in cuda_graph_time(fn_steps))
            rows.append(row("fused_recurrent_kda", name, "decode", shape, "gpu_time", "ms", one_call, gate=gate))
            rows.append(row("fused_recurrent_kda", name, "decode", shape, "gpu_time_per_step", "ms", gpu[name],
                            gate=gate))
            bandwidth[name] = tuple(state_bytes / (t * 1e-3) / 1e12 for t in reversed(gpu[name]))
            rows.append(row("fused_recurrent_kda", name, "decode", shape, "state_bandwidth", "TB/s", bandwidth[name],
                            gate=gate))
        host = _host_times_per_call(eager)
        for name, times in host.items():
            rows.append(row("fused_recurrent_kda", name, "decode", shape, "host_time_per_call", "ms", times, gate=gate))
        for name in ("ours (triton_decode)", "ours (fla path)"):
            err = rel_error(outputs[name], outputs["fla"])  # final states: fp32, so differences are the kernels'
            rows.append(row("fused_recurrent_kda", name, "decode", shape, "rel_err_vs_fla", "1", (err, err, err),
                            gate=gate))
            table.append([f"decode host/call: {name}", shape, host["fla"][1], host[name][1],
                          host["fla"][1] / host[name][1],
                          f"{err:.1e}; {1e3 * (host[name][1] - host['fla'][1]):+.1f} us per call"])
            bw_ours = bandwidth[name][1]
            rows.append(row("fused_recurrent_kda", name, "decode", shape, "fraction_of_copy_bandwidth", "1",
                            tuple(b / copy_bw[1] for b in bandwidth[name]), gate=gate))
            table.append([f"decode GPU (graph, per step of {len(steps)}): {name}", shape, gpu["fla"][1],
                          gpu[name][1],
                          gpu["fla"][1] / gpu[name][1],
                          f"state {bw_ours:.2f} TB/s = {100 * bw_ours / copy_bw[1]:.0f}% of copy {copy_bw[1]:.2f}"])


SMOKE_SHAPES = ("1x64x2", "varlen:16+0+47x2")  # --smoke: one batched and one packed call, an empty sequence


def run_smoke(args) -> list[dict]:
    """``--smoke``: the prefill comparison on a CPU at tiny shapes, ours only (our reference runs there; FLA and
    FlashKDA need CUDA), one round: checks the wiring, not the speed (times are CPU wall clock and operator
    time)."""
    gates = resolve_gates(args)
    shapes = args.shapes or [prefill_shapes(s)[0] for s in SMOKE_SHAPES]
    rows = []
    tables = kda_providers.bench_comparison(gates, shapes, "cpu", rows, rounds=1, selected=("ours",))
    for gate, lines in tables.items():
        print(f"\nKDA prefill forward, {gate} gate, CPU smoke run (ours only; wall and operator ms)")
        print(format_table(kda_providers.COMPARISON_HEADERS, lines))
    return rows


def run(args) -> list[dict]:
    if args.smoke:
        return run_smoke(args)
    gates = resolve_gates(args)
    if not torch.cuda.is_available():
        raise SystemExit("the KDA benchmark needs a CUDA device (--smoke runs a tiny CPU check)")
    torch.manual_seed(0)
    modes = args.modes
    rows = []
    env = environment()

    def checkpoint():
        write_csv([{**r, **env} for r in rows], args.csv)

    if "prefill" in modes:
        shapes = args.shapes or kda_providers.issue_shapes()
        shapes = shapes[:2] if args.quick else shapes
        tables = kda_providers.bench_comparison(gates, shapes, "cuda", rows, rounds=args.rounds,
                                                checkpoint=checkpoint, profile=args.profile,
                                                selected=args.providers)
        for gate, lines in tables.items():
            print(f"\nKDA prefill forward (inference), {gate} gate, bf16, K = V = {K}, in-kernel l2norm/gate/beta, "
                  f"fp32 state [N, H, V, K] in and out; median ms over {args.rounds} rounds (wall: one call with its "
                  "host time; kernels: summed GPU time per call)")
            print(format_table(kda_providers.COMPARISON_HEADERS, lines))
    if "cold_start" in modes:
        from kda_compile.bench.cold_start import bench_cold_start

        shape = (args.shapes or kda_providers.issue_shapes())[0]
        lines = []
        for gate in gates:
            skipped = kda_providers.skip_reasons(gate, selected=args.providers)
            providers = [p for p in kda_providers.PROVIDERS if p not in skipped]
            lines += bench_cold_start([gate], providers, shape.label, rows, row)
            checkpoint()
        print(f"\nKDA prefill cold start: the first call in a fresh process, empty Triton cache, {shape.label}")
        print(format_table(["gate", "provider", "first call (s)", "status"], lines))
    legacy = [m for m in modes if m not in ("prefill", "cold_start")]
    if not legacy:
        return rows
    providers = _providers()
    shapes = args.shapes or (PREFILL_SHAPES[:2] if args.quick else PREFILL_SHAPES)
    batches = DECODE_BATCHES[:2] if args.quick else DECODE_BATCHES
    for gate in gates:
        prefill_table = _bench_prefill(gate, legacy, shapes, "cuda", rows, checkpoint, profile=args.profile,
                                       rounds=args.rounds)
        if prefill_table:
            print(f"\nKDA prefill, bf16, K = V = {K}, {gate} gate, in-kernel l2norm/gate/beta, fp32 state (median ms)")
            print(format_table(PREFILL_HEADERS, prefill_table))
            suffix = "" if len(gates) == 1 else f"_{gate}"
            _plot_prefill_speedup(prefill_table, args.csv.with_name(f"{args.csv.stem}{suffix}_prefill_speedup.png"))
        if "decode" in legacy:
            table = []
            _bench_decode(providers, gate, batches, "cuda", rows, table, profile=args.profile)
            print(f"\nKDA, bf16, K = V = {K}, {gate} gate, in-kernel l2norm/gate/beta, fp32 state (median ms)")
            print(format_table(["mode", "B x T x H", "FLA", "kda_compile", "FLA / ours", "rel. err vs FLA"], table))
    return rows
