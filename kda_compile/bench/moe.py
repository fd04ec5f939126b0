"""Routed experts: kda_compile's ``moe_experts`` against Hugging Face's grouped-GEMM experts, side by side.

Widths of three released models (``--models``: qwen3_next E=512 K=10 H=2048 I=512, deepseek_v32 E=256 K=8 H=7168
I=2048, kimi_linear E=16 K=4 H=2304 I=1024 as the end-to-end benchmark builds it), bf16, random routing (top-K of a
softmax over random logits), T tokens per call (``--tokens``; decode at batch T is T tokens). Providers:
``kda_compile`` (the op's choice per call), ``kda_compile-triton`` / ``kda_compile-grouped_mm`` (one kernel
forced), ``hf_grouped_mm`` (``transformers.integrations.moe.grouped_mm_experts_forward``, HF's default). Each call
is replayed from a CUDA graph (no host time). Rows: time (ms), bandwidth (the hit experts' weights read once, as a
share of the measured copy bandwidth, %), and the relative error against the float32 reference.
"""
from __future__ import annotations

import logging
import types

import torch

from kda_compile.bench.common import (cuda_graph_time, format_table, measure_copy_bandwidth, named_choices, rel_error,
                                      row)

logger = logging.getLogger("kda_compile.bench.moe")

WIDTHS = {"qwen3_next": (512, 10, 2048, 512), "deepseek_v32": (256, 8, 7168, 2048), "kimi_linear": (16, 4, 2304, 1024)}
TOKENS = (1, 8, 64, 256, 1024)
PROVIDERS = ("kda_compile", "kda_compile-triton", "kda_compile-grouped_mm", "hf_grouped_mm")


def add_arguments(parser) -> None:
    parser.add_argument("--models", default=",".join(WIDTHS), help="comma-separated widths to measure")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated tokens per call")
    parser.add_argument("--providers", default=",".join(PROVIDERS), help="comma-separated providers")


def _hf_module(gate_up: torch.Tensor, down: torch.Tensor):
    """The attributes HF's ``grouped_mm_experts_forward`` reads of an experts module (Qwen3-Next's flags)."""
    from transformers.integrations import moe

    module = types.SimpleNamespace(num_experts=gate_up.shape[0], gate_up_proj=gate_up, down_proj=down,
                                   has_gate=True, has_bias=False, is_transposed=False, has_post_expert_norm=False,
                                   _is_expert_parallel=False, act_fn=torch.nn.functional.silu)
    module._apply_gate = lambda out: moe._default_apply_gate(module, out)
    return module


def _providers(names):
    from transformers.integrations.moe import grouped_mm_experts_forward

    from kda_compile.ops import moe_experts

    def ours(kernel):
        return lambda x, idx, w, gu, d: moe_experts(x, idx, w, gu, d, kernel=kernel)

    table = {"kda_compile": ours("auto"), "kda_compile-triton": ours("triton"),
             "kda_compile-grouped_mm": ours("grouped_mm"),
             "hf_grouped_mm": lambda x, idx, w, gu, d: grouped_mm_experts_forward(_hf_module(gu, d), x, idx, w)}
    return {n: table[n] for n in names}


def _inputs(experts, top_k, width, inter, tokens):
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    weights, index = torch.topk(torch.randn(tokens, experts, device="cuda").softmax(-1), top_k, dim=-1)
    gate_up = (torch.randn(experts, 2 * inter, width, device="cuda") / width ** 0.5).bfloat16()
    down = (torch.randn(experts, width, inter, device="cuda") / inter ** 0.5).bfloat16()
    return x, index, weights.bfloat16(), gate_up, down


def run(args) -> list[dict]:
    if not torch.cuda.is_available():
        raise SystemExit("the moe benchmark needs a CUDA device")
    from kda_compile.ops.moe.reference import moe_experts_reference

    models = named_choices(args.models, tuple(WIDTHS), "--models")
    providers = _providers(named_choices(args.providers, PROVIDERS, "--providers"))
    tokens_list = [int(t) for t in args.tokens.split(",") if t]
    torch.manual_seed(0)
    copy_tbs = measure_copy_bandwidth()[1]
    rows, table = [], []
    for model in models:
        experts, top_k, width, inter = WIDTHS[model]
        for tokens in tokens_list:
            x, index, weights, gate_up, down = _inputs(experts, top_k, width, inter, tokens)
            hit_bytes = torch.unique(index).numel() * 3 * width * inter * 2
            reference = moe_experts_reference(x.float(), index, weights.float(), gate_up, down)
            shape = f"{model} T={tokens}"
            base = None
            for name, call in providers.items():
                fn = (lambda call=call: call(x, index, weights, gate_up, down))
                try:
                    err = rel_error(fn(), reference)
                    times = cuda_graph_time(fn)
                except (RuntimeError, ValueError) as exc:  # a kernel that refuses the call
                    logger.info("%s %s: skipped (%s)", name, shape, str(exc).splitlines()[0][:160])
                    continue
                share = tuple(hit_bytes / (ms * 1e-3) / 1e12 / copy_tbs * 100 for ms in reversed(times))
                rows.append(row("moe_experts", name, "inference", shape, "time", "ms", times))
                rows.append(row("moe_experts", name, "inference", shape, "bandwidth", "% of copy", share))
                rows.append(row("moe_experts", name, "inference", shape, "rel_err_vs_fp32", "1", (err,) * 3))
                base = times[1] if name == "hf_grouped_mm" else base
                table.append([shape, name, times[1] * 1e3, f"{share[1]:.0f}%", f"{err:.1e}"])
            for line in table[-len(providers):]:
                line.append("-" if base is None else f"{base / (line[2] / 1e3):.2f}x")
    print(f"\nRouted experts, bf16, CUDA-graph replay (median; copy bandwidth {copy_tbs:.2f} TB/s)")
    print(format_table(["widths, tokens", "provider", "us", "of copy", "rel. err vs fp32", "vs hf_grouped_mm"],
                       table))
    return rows

