"""Softmax attention: kda_compile's op against torch SDPA (default choice and each backend forced).

Causal, 32 heads, bf16, Hugging Face layout (q/k/v are [B, H, T, D] views of [B, T, H, D] storage),
head dims 128/128 and 192/128 (MLA prefill), T in 1024 / 4096 / 8192; forward in inference mode and
forward+backward. Providers: ``kda_compile`` (the op, automatic dispatch), ``kda_compile-triton``
(the op forced onto our Triton kernel), ``sdpa`` (``F.scaled_dot_product_attention``'s own choice)
and ``sdpa-{cudnn,flash,efficient,math}`` (one backend forced; skipped where it refuses the shape or
runs out of memory). Rows: time (ms) and achieved TFLOP/s (causal: half the square), p20/p50/p80
from ``triton.testing.do_bench``, plus each provider's relative error against ``sdpa``.
"""
from __future__ import annotations

import argparse
import logging

import torch
import torch.nn.functional as F

from kda_compile.bench.common import format_table, rel_error, row, time_quantiles

logger = logging.getLogger("kda_compile.bench.attention")

HEADS = 32
LENGTHS = (1024, 4096, 8192)
HEAD_DIMS = ((128, 128), (192, 128))
SDPA_BACKENDS = ("cudnn", "flash", "efficient", "math")


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int, default=1, help="batch size (default: %(default)s)")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated sequence lengths")
    parser.add_argument("--head-dims", default="128/128,192/128", help="comma-separated d_qk/d_v pairs")
    parser.add_argument("--modes", default="fwd,fwd+bwd", help="comma-separated subset of fwd,fwd+bwd")
    parser.add_argument("--providers", default="kda_compile,kda_compile-triton,sdpa,sdpa-cudnn,sdpa-flash,"
                                               "sdpa-efficient,sdpa-math", help="comma-separated providers")
    parser.add_argument("--quick", action="store_true", help="T = 1024 and 4096, d 128 only")


def _providers(names):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kda_compile.ops.attention import attention, attention_backend

    kinds = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}

    def ours(forced):
        def call(q, k, v):
            with attention_backend(forced):
                return attention(q, k, v, is_causal=True)
        return call

    def sdpa(kind):
        def call(q, k, v):
            if kind is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            with sdpa_kernel(kinds[kind]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return call

    table = {"kda_compile": ours("auto"), "kda_compile-triton": ours("triton"), "sdpa": sdpa(None)}
    table.update({f"sdpa-{k}": sdpa(k) for k in SDPA_BACKENDS})
    unknown = set(names) - set(table)
    if unknown:
        raise SystemExit(f"--providers must name some of {sorted(table)}, got {sorted(unknown)}")
    return {n: table[n] for n in names}


def _inputs(b, t, dqk, dv, requires_grad):
    def make(d):
        return torch.randn(b, t, HEADS, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_(
            requires_grad)
    return make(dqk), make(dqk), make(dv)


def _causal_flops(b, t, dqk, dv, mode) -> float:
    fwd = 2.0 * b * HEADS * t * t * (dqk + dv) / 2  # QK^T and PV over the lower triangle
    return fwd * (3.5 if mode == "fwd+bwd" else 1.0)  # backward: 2.5x the forward (recomputes QK^T)


def _bench_shape(providers, b, t, dqk, dv, mode, rows, table):
    shape = f"{b}x{t}x{HEADS}xd{dqk}/{dv}"
    q, k, v = _inputs(b, t, dqk, dv, requires_grad=(mode == "fwd+bwd"))
    grad = torch.randn(b, HEADS, t, dv, device="cuda", dtype=torch.bfloat16)
    flops = _causal_flops(b, t, dqk, dv, mode)
    outputs, medians = {}, {}
    for name, call in providers.items():
        if mode == "fwd":
            def fn(call=call):
                with torch.no_grad():
                    return call(q, k, v)
        else:
            def fn(call=call):
                out = call(q, k, v)
                torch.autograd.grad(out, (q, k, v), grad)
                return out
        try:
            outputs[name] = fn().detach()
            times = time_quantiles(fn)
        except (RuntimeError, ValueError, torch.OutOfMemoryError) as exc:  # backend refuses the shape / OOM
            logger.info("%s %s %s: skipped (%s)", name, mode, shape, str(exc).splitlines()[0][:160])
            torch.cuda.empty_cache()
            continue
        medians[name] = times[1]
        rows.append(row("attention", name, mode, shape, "time", "ms", times))
        rows.append(row("attention", name, mode, shape, "throughput", "TFLOP/s",
                        tuple(flops / (ms * 1e-3) / 1e12 for ms in reversed(times))))
        torch.cuda.empty_cache()
    reference = outputs.get("sdpa")
    for name, out in outputs.items():
        err = rel_error(out, reference) if reference is not None else float("nan")
        rows.append(row("attention", name, mode, shape, "rel_err_vs_sdpa", "1", (err, err, err)))
    for name, ms in medians.items():
        base = medians.get("sdpa")
        table.append([mode, shape, name, ms, flops / (ms * 1e-3) / 1e12, "" if base is None else f"{base / ms:.2f}x",
                      f"{rel_error(outputs[name], reference):.1e}" if reference is not None else "-"])


def run(args) -> list[dict]:
    if not torch.cuda.is_available():
        raise SystemExit("the attention benchmark needs a CUDA device")
    torch.manual_seed(0)
    providers = _providers([p for p in args.providers.split(",") if p])
    lengths = [int(t) for t in args.lengths.split(",")]
    dims = [tuple(int(x) for x in pair.split("/")) for pair in args.head_dims.split(",")]
    if args.quick:
        lengths, dims = [t for t in lengths if t <= 4096], dims[:1]
    rows, table = [], []
    for mode in args.modes.split(","):
        for dqk, dv in dims:
            for t in lengths:
                _bench_shape(providers, args.batch, t, dqk, dv, mode, rows, table)
    print(f"\nSoftmax attention, causal, {HEADS} heads, bf16, HF layout (median ms)")
    print(format_table(["mode", "B x T x H x d", "provider", "ms", "TFLOP/s", "vs sdpa", "rel. err vs sdpa"], table))
    return rows


def main(argv=None) -> list[dict]:
    """Standalone entry (``python -m kda_compile.bench.attention``); returns the rows."""
    parser = argparse.ArgumentParser(prog="python -m kda_compile.bench.attention", description=__doc__)
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
