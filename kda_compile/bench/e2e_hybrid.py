"""End to end for hybrid linear-attention models (Kimi-Linear: KDA + MLA; Qwen3-Next: GDN + softmax attention):
the machinery both share (``python -m kda_compile.bench e2e --model kimi_linear | qwen3_next``).

A model is described by a ``HybridModel`` (``e2e_kimi.py``, ``e2e_qwen3_next.py``): how to build it from transformers
with random weights at given widths and layer count, and which of HF's module-level kernel names bind FLA.
Configurations:

- ``hf_eager_fla``: eager, HF's linear-attention functions bound to flash-linear-attention (FLA installed);
- ``hf_eager_torch``: eager, HF's torch fallbacks (what HF runs without FLA; prompts above
  ``--torch-max-prompt`` are skipped: HF's chunk fallbacks are memory-hungry). The model is the same; HF's
  module-level names are pointed at their ``__wrapped__`` torch functions while this configuration runs;
- ``inductor``: ``torch.compile`` with Inductor of the model as installed (FLA bound when present: a graph
  break at each FLA call). kda_compile's trace-time substitution is process-wide once kda_compile is imported,
  so this runs kda_compile's backend with every rewrite and the substitution off: Inductor's ``compile_fx`` on
  the graph Dynamo traced from HF's code, as ``torch.compile`` does without kda_compile;
- ``kda_compile``: ``kda_compile.optimize`` (default Config, Inductor);
- ``kda_compile (cuda graphs)``: ``kda_compile.optimize(..., mode="reduce-overhead")`` decoding into HF's
  ``StaticCache``: the prefill runs compiled without CUDA graphs, each decode step replays one CUDA graph
  (docs/cuda-graphs.md). Its prefill rows are the same graphs as ``kda_compile``'s and are not repeated.

Metrics (median of repeats, also p20 / p80 in the CSV):

- prefill: one forward of the prompt with a fresh cache and ``logits_to_keep=1`` (what ``generate()`` runs
  first), tokens per second at each ``--prompts`` length;
- decode, for each ``--decode-shapes`` entry ``BxP`` (batch x prompt; the CSV's shape is ``BxP+N``): after a
  P-token prefill (not timed), a timed loop of ``--new-tokens`` (N) single-token forwards with the cache, each
  feeding back the greedy tokens (what ``generate()`` does per step, without its logits processors):
  ``time_per_token`` (wall-clock ms per decode step, i.e. per generated token of each sequence);
  ``gpu_time_per_token`` (the summed GPU time of the step's kernels, torch.profiler, ms) and
  ``kernels_per_step`` (the kernels and memory operations the profiler records per step), from a separate,
  profiled loop.

Compiled configurations compile ``model.forward`` (as for ``generate()``), with automatic dynamic shapes; a
warm-up pass over every prompt length and one decode loop compiles everything before timing. Each
configuration runs in a try/except: a failure (FLA missing, out of memory, a compile error) is recorded and
printed, and the others still run. Prefill logits of each configuration are compared with the first
configuration that ran (relative error of the last token's logits), decode tokens likewise.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from kda_compile.bench.common import format_table, row, time_quantiles

logger = logging.getLogger("kda_compile.bench.e2e_hybrid")

CUDA_GRAPHS = "kda_compile (cuda graphs)"
CONFIGURATIONS = ("hf_eager_fla", "hf_eager_torch", "inductor", "kda_compile", CUDA_GRAPHS)
COMPILED = ("inductor", "kda_compile", CUDA_GRAPHS)


@dataclass(frozen=True)
class HybridModel:
    """What the runner needs of one model family.

    ``name`` prefixes the CSV's op names (``<name>_prefill``, ``<name>_decode``); ``title`` heads the printed
    tables; ``hf_module`` holds ``kernel_names``, HF's module-level wrappers bound to FLA at import (the first:
    the chunked prefill function); ``build(shape, layers, device, dtype)`` returns the causal LM in eval mode with
    random weights (seeded) at the widths of ``shape`` (the released model's) or ``tiny`` (the CPU smoke run),
    each with a ``hidden`` and a ``vocab`` (bounds the token ids)."""

    name: str
    title: str
    hf_module: str
    kernel_names: tuple[str, ...]
    build: Callable[..., Any]
    shape: Any
    tiny: Any


@dataclass(frozen=True)
class Options:
    shape: Any
    layers: int = 4
    prompts: tuple[int, ...] = (1024, 4096)
    decode_shapes: tuple[tuple[int, int], ...] = ((1, 512), (1, 8192), (64, 512))  # (batch, prompt)
    new_tokens: int = 32
    repeats: int = 5
    torch_max_prompt: int = 1024
    configs: tuple[str, ...] = CONFIGURATIONS
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    compiler: str = "inductor"  # kda_compile.Config.compiler ("aot_eager" for the CPU smoke run)
    mode: str | None = None  # torch.compile mode of the compiled configurations


def layer_types(layers: int) -> list[str]:
    """Every fourth layer is softmax attention (full attention), the rest linear attention: the 3 : 1 pattern of
    the released Kimi-Linear and Qwen3-Next."""
    return ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]


def smoke_options(model: HybridModel) -> Options:
    """Tiny widths on CPU in fp32, kda_compile on aot_eager: checks the wiring, not the speed."""
    return Options(shape=model.tiny, layers=4, prompts=(8,), decode_shapes=((1, 8), (2, 8)), new_tokens=2, repeats=1,
                   torch_max_prompt=64, configs=("hf_eager_fla", "hf_eager_torch", "kda_compile", CUDA_GRAPHS),
                   device="cpu", dtype=torch.float32, compiler="aot_eager")


def parse_decode_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``"1x512,64x512"`` -> ((1, 512), (64, 512)); a clear error for anything else."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise SystemExit(f"--decode-shapes must be comma-separated BATCHxPROMPT entries of positive integers "
                             f"(e.g. 1x512,64x512), got {item!r}")
        shapes.append((int(parts[0]), int(parts[1])))
    return tuple(shapes)


def decode_shape_name(batch: int, prompt: int, new_tokens: int) -> str:
    return f"{batch}x{prompt}+{new_tokens}"


def bound_implementation(model: HybridModel) -> str:
    """Where HF's chunked function points: ``fla...`` or HF's own torch fallback."""
    from kda_compile.passes.kda_substitution import hf_bound_implementation

    fn = getattr(importlib.import_module(model.hf_module), model.kernel_names[0])
    implementation = hf_bound_implementation(fn)
    return f"{implementation.__module__}.{implementation.__name__}"


@contextlib.contextmanager
def kernel_binding(model: HybridModel, binding: str):
    """``"fla"``: require HF's functions to be FLA's; ``"torch"``: point HF's module-level names at their torch
    fallbacks (``__wrapped__``) for the duration; ``"installed"``: as is."""
    module = importlib.import_module(model.hf_module)
    if binding == "fla" and not bound_implementation(model).startswith("fla."):
        raise RuntimeError(f"HF's {model.title} code bound {bound_implementation(model)}: flash-linear-attention was "
                           "not importable when transformers loaded the model code (pip install \"kda-compile[fla]\")")
    from kda_compile.passes.kda_substitution import hf_torch_path

    with hf_torch_path(module, *(model.kernel_names if binding == "torch" else ())):
        yield


def _compiled_forward(model, name: str, opts: Options):
    import kda_compile
    from kda_compile.backend import KdaCompileBackend

    kwargs = {} if opts.mode is None else {"mode": opts.mode}
    if name == CUDA_GRAPHS:
        return kda_compile.optimize(model.forward, kda_compile.Config(compiler=opts.compiler), mode="reduce-overhead")
    if name == "kda_compile":
        return kda_compile.optimize(model.forward, kda_compile.Config(compiler=opts.compiler), **kwargs)
    switches = {f.name: False for f in dataclasses.fields(kda_compile.Config) if f.type in (bool, "bool")}
    plain = KdaCompileBackend(kda_compile.Config(compiler=opts.compiler, **switches))
    return torch.compile(model.forward, backend=plain, **kwargs)


def _timed(fn, device: str, reps: int = 3) -> tuple[float, float, float]:
    """p20 / p50 / p80 milliseconds: CUDA events (triton's do_bench) on CUDA, a wall clock elsewhere."""
    if device == "cuda":
        return time_quantiles(fn, warmup_ms=50, rep_ms=500)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    samples.sort()
    return samples[len(samples) // 5], samples[len(samples) // 2], samples[(4 * len(samples)) // 5]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def prefill(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits[:, -1]


def new_cache(model, name: str, length: int):
    """The cache a configuration decodes into: HF's ``StaticCache`` (``length`` tokens) for CUDA graphs,
    None (the model makes its ``DynamicCache``) otherwise."""
    if name != CUDA_GRAPHS:
        return None
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=length)


def _decode_steps(model, ids, new_tokens: int, cache, step_hook=None):
    """Prefill ``ids`` into ``cache`` (a fresh DynamicCache when None; a StaticCache is reset first), then
    ``new_tokens`` greedy single-token forwards; returns the [B, new_tokens] tokens. ``step_hook(i)`` runs
    before step i (the timers)."""
    if cache is not None:
        cache.reset()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    tokens = []
    for i in range(new_tokens):
        if step_hook is not None:
            step_hook(i)
        out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        tokens.append(token)
    if step_hook is not None:
        step_hook(new_tokens)
    return torch.cat(tokens, 1)


def decode_ms_per_token(model, ids, new_tokens: int, device: str, cache=None) -> tuple[float, list[int]]:
    """Greedy decode loop after an untimed prefill: (wall ms per step, the first sequence's tokens)."""
    marks = []

    def mark(i):
        if i in (0, new_tokens):
            _sync(device)
            marks.append(time.perf_counter())

    with torch.inference_mode():
        tokens = _decode_steps(model, ids, new_tokens, cache, mark)
    return (marks[1] - marks[0]) * 1e3 / new_tokens, [int(t) for t in tokens[0].tolist()]


def decode_gpu_time(model, ids, new_tokens: int, cache=None) -> tuple[float, float]:
    """(GPU ms per decode step, kernels per step): the kernels torch.profiler records over ``new_tokens``
    decode steps after an unprofiled prefill."""
    from torch.profiler import ProfilerActivity, profile

    state = {}

    def mark(i):
        if i == 0:
            torch.cuda.synchronize()
            state["prof"] = profile(activities=[ProfilerActivity.CUDA])
            state["prof"].__enter__()
        elif i == new_tokens:
            torch.cuda.synchronize()
            state["prof"].__exit__(None, None, None)

    with torch.inference_mode():
        _decode_steps(model, ids, new_tokens, cache, mark)
    kernels = [e for e in state["prof"].events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / 1e3 / new_tokens, len(kernels) / new_tokens


def _quantiles(samples: list[float]) -> tuple[float, float, float]:
    samples = sorted(samples)
    n = len(samples)
    return samples[n // 5], samples[n // 2], samples[(4 * n) // 5]


def _decode_rows(spec: HybridModel, name: str, opts: Options, model, decode_ids: dict, shapes) -> tuple[list, dict]:
    """The decode rows of one configuration and its tokens per decode shape."""
    rows, tokens = [], {}
    for batch, prompt in shapes:
        ids = decode_ids[(batch, prompt)]
        shape = decode_shape_name(batch, prompt, opts.new_tokens)
        cache = new_cache(model, name, prompt + opts.new_tokens + 1)
        decode_ms_per_token(model, ids, 2, opts.device, cache)  # compiles / records the decode graph
        per_token = []
        for _ in range(opts.repeats):
            ms, tokens[shape] = decode_ms_per_token(model, ids, opts.new_tokens, opts.device, cache)
            per_token.append(ms)
        decode = _quantiles(per_token)
        rows.append(row(f"{spec.name}_decode", name, "inference", shape, "time_per_token", "ms", decode))
        line = f"{name} decode {shape}: {decode[1]:.3f} ms/token"
        if opts.device == "cuda":
            gpu_ms, kernels = decode_gpu_time(model, ids, opts.new_tokens, cache)
            rows.append(row(f"{spec.name}_decode", name, "inference", shape, "gpu_time_per_token", "ms",
                            (gpu_ms, gpu_ms, gpu_ms)))
            rows.append(row(f"{spec.name}_decode", name, "inference", shape, "kernels_per_step", "count",
                            (kernels, kernels, kernels)))
            line += f", GPU {gpu_ms:.3f} ms/token, {kernels:.0f} kernels/step"
        logger.info("%s", line)
    return rows, tokens


def _run_configuration(spec: HybridModel, name: str, opts: Options, prompts: dict[int, torch.Tensor],
                       decode_ids: dict):
    """Rows, last-token logits per prompt and the decode tokens (per decode shape) of one configuration."""
    binding = {"hf_eager_fla": "fla", "hf_eager_torch": "torch"}.get(name, "installed")
    short_only = name == "hf_eager_torch" or (name == "inductor" and not bound_implementation(spec).startswith("fla."))
    lengths = [T for T in prompts if not short_only or T <= opts.torch_max_prompt]
    shapes = [s for s in opts.decode_shapes if not short_only or s[0] * s[1] <= opts.torch_max_prompt]
    skipped = [T for T in prompts if T not in lengths] + [s for s in opts.decode_shapes if s not in shapes]
    if skipped:
        logger.info("%s: prompts / decode shapes %s skipped (HF's torch fallback; --torch-max-prompt %d)", name,
                    skipped, opts.torch_max_prompt)
    if name == CUDA_GRAPHS:
        lengths = []  # its prefill graphs are kda_compile's (captured only for decode)
    rows, logits, model, tokens = [], {}, None, {}
    try:
        with kernel_binding(spec, binding):
            model = spec.build(opts.shape, opts.layers, opts.device, opts.dtype)
            if name in COMPILED:
                model.forward = _compiled_forward(model, name, opts)
                for T in lengths:  # warm-up: compile prefill for every length
                    prefill(model, prompts[T])
            for T in lengths:
                logits[T] = prefill(model, prompts[T]).float().cpu()
                times = _timed(lambda: prefill(model, prompts[T]), opts.device)
                shape = f"1x{T}"
                rows.append(row(f"{spec.name}_prefill", name, "inference", shape, "time", "ms", times))
                rows.append(row(f"{spec.name}_prefill", name, "inference", shape, "tokens_per_s", "tok/s",
                                tuple(T / (t * 1e-3) for t in reversed(times))))
                logger.info("%s prefill T=%d: %.2f ms", name, T, times[1])
            got, tokens = _decode_rows(spec, name, opts, model, decode_ids, shapes)
            rows += got
            if name in ("kda_compile", CUDA_GRAPHS):
                import kda_compile

                logger.info("%s report:\n%s", name, kda_compile.report(model.forward))
    finally:
        del model
        gc.collect()
        if opts.device == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset()
    return rows, logits, tokens


def measure(spec: HybridModel, opts: Options) -> tuple[list[dict], dict[str, str], dict]:
    """Run every configuration; returns (CSV rows, failures by configuration, summary for the table)."""
    gen = torch.Generator().manual_seed(0)
    vocab = opts.shape.vocab
    prompts = {T: torch.randint(3, vocab, (1, T), generator=gen).to(opts.device) for T in opts.prompts}
    decode_ids = {(B, P): torch.randint(3, vocab, (B, P), generator=gen).to(opts.device)
                  for B, P in opts.decode_shapes}
    rows, failures, logits, tokens = [], {}, {}, {}
    for name in opts.configs:
        try:
            got, logits[name], tokens[name] = _run_configuration(spec, name, opts, prompts, decode_ids)
            rows += got
        except Exception as exc:  # noqa: BLE001  (record it, run the other configurations)
            failures[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            logger.warning("%s failed: %s", name, failures[name], exc_info=logger.isEnabledFor(logging.DEBUG))
    return rows, failures, {"logits": logits, "tokens": tokens}


def _median(rows, op, provider, shape, metric):
    for r in rows:
        if (r["op"], r["provider"], r["shape"], r["metric"]) == (op, provider, shape, metric):
            return r["p50"]
    return None


def print_tables(spec: HybridModel, opts: Options, rows: list[dict], failures: dict[str, str], summary: dict) -> None:
    ran = [c for c in opts.configs if c not in failures]
    reference = ran[0] if ran else None
    prefill_op, decode_op = f"{spec.name}_prefill", f"{spec.name}_decode"
    lines = []
    for T in opts.prompts:
        base = _median(rows, prefill_op, "hf_eager_fla", f"1x{T}", "time")
        ind = _median(rows, prefill_op, "inductor", f"1x{T}", "time")
        for name in ran:
            ms = _median(rows, prefill_op, name, f"1x{T}", "time")
            if ms is None:
                continue
            ref = summary["logits"].get(reference, {}).get(T)
            got = summary["logits"][name].get(T)
            err = ("-" if ref is None or got is None or name == reference
                   else f"{((got - ref).norm() / ref.norm()).item():.1e}")
            lines.append([T, name, ms, T / (ms * 1e-3), "-" if base is None else base / ms,
                          "-" if ind is None else ind / ms, err])
    print(f"\n{spec.title}-shaped, {opts.layers} layers {layer_types(opts.layers)}, hidden {opts.shape.hidden}, "
          f"{str(opts.dtype).replace('torch.', '')}, batch 1: prefill (median; logits_to_keep=1)")
    print(format_table(["prompt", "configuration", "ms", "tokens/s", "x vs hf_eager_fla", "x vs inductor",
                        f"rel. err vs {reference}"], lines))
    lines = []
    for batch, prompt in opts.decode_shapes:
        shape = decode_shape_name(batch, prompt, opts.new_tokens)
        base = _median(rows, decode_op, "hf_eager_fla", shape, "time_per_token")
        ref = summary["tokens"].get(reference, {}).get(shape)
        for name in ran:
            ms = _median(rows, decode_op, name, shape, "time_per_token")
            if ms is None:
                continue
            gpu = _median(rows, decode_op, name, shape, "gpu_time_per_token")
            kernels = _median(rows, decode_op, name, shape, "kernels_per_step")
            got = summary["tokens"][name].get(shape)
            same = "-" if ref is None or got is None else f"{sum(a == b for a, b in zip(got, ref))}/{len(ref)}"
            lines.append([shape, name, ms, "-" if gpu is None else gpu, "-" if gpu is None else ms / gpu,
                          "-" if kernels is None else f"{kernels:.0f}", "-" if base is None else base / ms, same])
    print(f"\nDecode: {opts.new_tokens} greedy single-token forwards with the cache after the prompt (batch x "
          f"prompt + new tokens; median of {opts.repeats})")
    print(format_table(["shape", "configuration", "ms per token", "GPU ms per token", "wall / GPU", "kernels per step",
                        "x vs hf_eager_fla", f"tokens equal to {reference}"], lines))
    for name, why in failures.items():
        print(f"\nFAILED {name}: {why}")


def run(spec: HybridModel, args) -> list[dict]:
    """The CLI entry for one model: ``--smoke`` runs ``smoke_options`` (tiny widths on CPU), else the released
    widths on CUDA."""
    if args.smoke:
        smoke = smoke_options(spec)
        rows, failures, summary = measure(spec, smoke)
        print_tables(spec, smoke, rows, failures, summary)
        return rows
    if not torch.cuda.is_available():
        raise SystemExit(f"the {spec.title} end-to-end benchmark needs a CUDA device (--smoke runs a tiny CPU check)")
    opts = Options(shape=spec.shape, layers=args.layers or 4,
                   prompts=tuple(int(p) for p in (args.prompts or "1024,4096").split(",")),
                   decode_shapes=parse_decode_shapes(args.decode_shapes), new_tokens=args.new_tokens,
                   repeats=args.decode_repeats,
                   torch_max_prompt=args.torch_max_prompt, mode=args.compile_mode,
                   configs=tuple((args.configs or ",".join(CONFIGURATIONS)).split(",")))
    unknown = [c for c in opts.configs if c not in CONFIGURATIONS]
    if unknown:
        raise SystemExit(f"--configs must name configurations among {', '.join(CONFIGURATIONS)}, got {unknown}")
    logger.info("HF's %s functions are bound to %s", spec.title, bound_implementation(spec))
    rows, failures, summary = measure(spec, opts)
    print_tables(spec, opts, rows, failures, summary)
    return rows
