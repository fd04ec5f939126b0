"""End to end for Hugging Face causal LMs, prefill and decode: the machinery the end-to-end model benchmarks share
(``python -m kda_compile.bench e2e --model kimi_linear | qwen3_next | deepseek_v32 | llama``).

A model is described by a ``HybridModel`` (``e2e_kimi.py``, ``e2e_qwen3_next.py``: hybrid linear-attention models,
KDA + MLA and GDN + softmax attention; ``e2e_deepseek_v32.py``: MLA with the DSA indexer; ``e2e_llama.py``: the
Llama-3.1-8B-shaped decode model): how to build it from transformers with random weights at given widths and layer
count, and which of HF's module-level kernel names bind FLA (none for the models without FLA kernels).
Configurations:

- ``hf_eager_fla`` (models with FLA kernels): eager, HF's linear-attention functions bound to flash-linear-attention
  (FLA installed);
- ``hf_eager_torch`` (models with FLA kernels): eager, HF's torch fallbacks (what HF runs without FLA; prompts above
  ``--torch-max-prompt`` are skipped: HF's chunk fallbacks are memory-hungry). The model is the same; HF's
  module-level names are pointed at their ``__wrapped__`` torch functions while this configuration runs;
- ``hf_eager`` (models without FLA kernels, in place of the two above): HF eager as installed, nothing bound;
- ``inductor``: ``torch.compile`` with Inductor of the model as installed (FLA bound when present: a graph
  break at each FLA call). kda_compile's trace-time substitution is process-wide once kda_compile is first used
  (kda_compile/process_hooks.py), so this runs kda_compile's backend with every rewrite and the substitution off: Inductor's ``compile_fx`` on
  the graph Dynamo traced from HF's code, as ``torch.compile`` does without kda_compile;
- ``kda_compile``: ``kda_compile.optimize`` (default Config, Inductor);
- ``kda_compile (cuda graphs)``: ``kda_compile.optimize(..., mode="reduce-overhead")`` decoding into HF's
  ``StaticCache``: the prefill runs compiled without CUDA graphs, each decode step replays one CUDA graph
  (docs/cuda-graphs.md). Its prefill rows are the same graphs as ``kda_compile``'s and are not repeated.
- ``kda_compile (cuda graphs; skip_decode_guards)``: the same with ``Config(skip_decode_guards=True)``: a warm
  decode step runs only Dynamo's differentiating guards (docs/cuda-graphs.md, section 9).

The first HF eager configuration of a model (``hf_eager_fla``, or ``hf_eager``) is its baseline: the tables'
speedup columns divide its time by each configuration's.

Metrics (median of repeats, also p20 / p80 in the CSV):

- prefill: one forward of the prompt with a fresh cache and ``logits_to_keep=1`` (what ``generate()`` runs
  first), tokens per second at each ``--prompts`` length (a model's default prompts may be none: the decode-only
  models measure prefill only when ``--prompts`` asks);
- decode, for each ``--decode-shapes`` entry ``BxP`` (batch x prompt; the CSV's shape is ``BxP+N``): after a
  P-token prefill (not timed), a timed loop of ``--new-tokens`` (N) single-token forwards with the cache, each
  feeding back the greedy tokens (what ``generate()`` does per step, without its logits processors):
  ``time_per_token`` (wall-clock ms per decode step, i.e. per generated token of each sequence);
  ``gpu_time_per_token`` (the summed GPU time of the step's kernels, torch.profiler, ms) and
  ``kernels_per_step`` (the kernels and memory operations the profiler records per step), from a separate,
  profiled loop; the log lists that loop's kernels by name (launches and GPU time per step), where a step's
  launches go; ``host_time_per_token`` (ms: the median host time of a step started with the GPU idle, from a
  third loop that synchronizes before each step): a step is host-bound when it nears the GPU time.

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
CUDA_GRAPHS_SKIP_GUARDS = "kda_compile (cuda graphs; skip_decode_guards)"
CAPTURED = (CUDA_GRAPHS, CUDA_GRAPHS_SKIP_GUARDS)  # the configurations decoding in CUDA graphs
FLA_BASELINES = ("hf_eager_fla", "hf_eager_torch")  # HF eager of a model whose HF code binds FLA kernels
PLAIN_BASELINE = "hf_eager"  # HF eager of a model without FLA kernels: nothing to bind
COMPILED = ("inductor", "kda_compile", *CAPTURED)
CONFIGURATIONS = FLA_BASELINES + COMPILED  # a model with FLA kernels (HybridModel.configurations)
BINDINGS = ("fla", "torch", "installed")
DEFAULT_DECODE_SHAPES = "1x512,1x8192,64x512"  # --decode-shapes when not given


def layer_types(layers: int) -> list[str]:
    """Every fourth layer is softmax attention (full attention), the rest linear attention: the 3 : 1 pattern of
    the released Kimi-Linear and Qwen3-Next."""
    return ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]


@dataclass(frozen=True)
class HybridModel:
    """What the runner needs of one model family.

    ``name`` prefixes the CSV's op names (``<name>_prefill``, ``<name>_decode``); ``title`` heads the printed
    tables; ``build(shape, layers, device, dtype)`` returns the causal LM in eval mode with random weights (seeded)
    at the widths of ``shape`` (the released model's) or ``tiny`` (the CPU smoke run), each with a ``hidden`` and a
    ``vocab`` (bounds the token ids). ``hf_module`` holds ``kernel_names``, HF's module-level wrappers bound to FLA at
    import (the first: the chunked prefill function); a model without them (HF eager is all torch) has the one
    baseline ``hf_eager``. ``prompts``: the prefill lengths measured when ``--prompts`` is not given (none: decode
    rows only). ``describe_layers(layers)``: the layer stack as the tables' heading shows it."""

    name: str
    title: str
    build: Callable[..., Any]
    shape: Any
    tiny: Any
    hf_module: str = ""
    kernel_names: tuple[str, ...] = ()
    prompts: tuple[int, ...] = (1024, 4096)
    describe_layers: Callable[[int], list[str]] = layer_types

    @property
    def baselines(self) -> tuple[str, ...]:
        """The HF eager configurations: with FLA's kernels and with HF's torch fallbacks where HF binds kernels;
        plain HF eager where there is nothing to bind (``hf_eager_fla`` would mean nothing there)."""
        return FLA_BASELINES if self.kernel_names else (PLAIN_BASELINE,)

    @property
    def baseline(self) -> str:
        """The configuration the speedup columns divide by."""
        return self.baselines[0]

    @property
    def configurations(self) -> tuple[str, ...]:
        return self.baselines + COMPILED


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


def smoke_options(model: HybridModel) -> Options:
    """Tiny widths on CPU in fp32, kda_compile on aot_eager: checks the wiring, not the speed. One short prefill
    even for a model whose default has none, so the prefill table's wiring is checked too."""
    return Options(shape=model.tiny, layers=4, prompts=(8,), decode_shapes=((1, 8), (2, 8)), new_tokens=2, repeats=1,
                   torch_max_prompt=64, configs=model.baselines + ("kda_compile", CUDA_GRAPHS),
                   device="cpu", dtype=torch.float32, compiler="aot_eager")


def _positive_int(text: str, option: str, example: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise SystemExit(f"{option} must be comma-separated positive integers (e.g. {example}), got {text!r}")
    return int(text)


def parse_lengths(text: str | None, default: tuple[int, ...], option: str = "--prompts",
                  example: str = "1024,4096") -> tuple[int, ...]:
    """``"1024,4096"`` -> (1024, 4096); None -> ``default``; anything else is refused naming ``option``."""
    if text is None:
        return default
    return tuple(_positive_int(p, option, example) for p in text.split(","))


def parse_prompts(text: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    """``--prompts``: ``"1024,4096"`` -> (1024, 4096); None -> the model's default prompts."""
    return parse_lengths(text, default)


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


def parse_configs(text: str | None, model: HybridModel) -> tuple[str, ...]:
    """``--configs``: a comma-separated subset of the model's configurations (all of them when None)."""
    if text is None:
        return model.configurations
    configs = tuple(c.strip() for c in text.split(","))
    unknown = [c for c in configs if c not in model.configurations]
    if unknown:
        raise SystemExit(f"--configs for the {model.title}-shaped model must name configurations among "
                         f"{', '.join(model.configurations)}, got {unknown}")
    return configs


def decode_shape_name(batch: int, prompt: int, new_tokens: int) -> str:
    return f"{batch}x{prompt}+{new_tokens}"


def uses_fla(model: HybridModel) -> bool:
    """Whether HF's code of ``model`` calls FLA's kernels as installed (its functions bound at import)."""
    return bool(model.kernel_names) and bound_implementation(model).startswith("fla.")


def bound_implementation(model: HybridModel) -> str:
    """Where HF's chunked function points: ``fla...`` or HF's own torch fallback; a model without kernel names
    says so (HF eager there is torch throughout)."""
    if not model.kernel_names:
        return "nothing (no module-level kernels: HF eager is torch throughout)"
    from kda_compile.passes.substitution.install import hf_bound_implementation

    fn = getattr(importlib.import_module(model.hf_module), model.kernel_names[0])
    implementation = hf_bound_implementation(fn)
    return f"{implementation.__module__}.{implementation.__name__}"


@contextlib.contextmanager
def kernel_binding(model: HybridModel, binding: str):
    """``"fla"``: require HF's functions to be FLA's; ``"torch"``: point HF's module-level names at their torch
    fallbacks (``__wrapped__``) for the duration; ``"installed"``: as is. A model without kernel names is the same
    model under ``"torch"`` and ``"installed"``; ``"fla"`` is refused there (it has no FLA path to require)."""
    if binding not in BINDINGS:
        raise ValueError(f"binding must be one of {', '.join(BINDINGS)}, got {binding!r}")
    if not model.kernel_names:
        if binding == "fla":
            raise ValueError(f"binding 'fla' needs HF kernel names to bind, and {model.title} has none "
                             f"(its configurations: {', '.join(model.configurations)})")
        yield
        return
    module = importlib.import_module(model.hf_module)
    if binding == "fla" and not uses_fla(model):
        raise RuntimeError(f"HF's {model.title} code bound {bound_implementation(model)}: flash-linear-attention was "
                           "not importable when transformers loaded the model code (pip install \"kda-compile[fla]\")")
    from kda_compile.passes.substitution.install import hf_torch_path

    with hf_torch_path(module, *(model.kernel_names if binding == "torch" else ())):
        yield


def _compiled_forward(model, name: str, opts: Options):
    import kda_compile
    from kda_compile.backend import KdaCompileBackend

    kwargs = {} if opts.mode is None else {"mode": opts.mode}
    if name in CAPTURED:
        config = kda_compile.Config(compiler=opts.compiler, skip_decode_guards=name == CUDA_GRAPHS_SKIP_GUARDS)
        return kda_compile.optimize(model.forward, config, mode="reduce-overhead")
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


def synchronize(device: str) -> None:
    """Wait for the device's work (nothing to wait for off CUDA)."""
    if device == "cuda":
        torch.cuda.synchronize()


def prefill(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits[:, -1]


def new_cache(model, name: str, length: int):
    """The cache a configuration decodes into: HF's ``StaticCache`` (``length`` tokens) for CUDA graphs,
    None (the model makes its ``DynamicCache``) otherwise."""
    if name not in CAPTURED:
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
            synchronize(device)
            marks.append(time.perf_counter())

    with torch.inference_mode():
        tokens = _decode_steps(model, ids, new_tokens, cache, mark)
    return (marks[1] - marks[0]) * 1e3 / new_tokens, [int(t) for t in tokens[0].tolist()]


def decode_host_ms(model, ids, new_tokens: int, device: str, cache=None) -> float:
    """Median host time of one decode step started with the device idle (synchronized before it, the timer
    stopped before the next synchronisation): the step's Python, Dynamo's guards and the launches, none of the
    GPU's time. A step whose host time nears its GPU time is host-bound."""
    samples, started = [], []

    def mark(i):
        if started:
            samples.append((time.perf_counter() - started.pop()) * 1e3)
        if i < new_tokens:
            synchronize(device)
            started.append(time.perf_counter())

    with torch.inference_mode():
        _decode_steps(model, ids, new_tokens, cache, mark)
    return _quantiles(samples)[1]


def decode_gpu_time(model, ids, new_tokens: int, cache=None) -> tuple[float, float, list[tuple[str, float, float]]]:
    """(GPU ms per decode step, kernels per step, the step's kernels by name): the kernels torch.profiler
    records over ``new_tokens`` decode steps after an unprofiled prefill; the last item is ``kernel_breakdown``'s."""
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
    breakdown = kernel_breakdown([(e.name, e.device_time) for e in kernels], new_tokens)
    return sum(e.device_time for e in kernels) / 1e3 / new_tokens, len(kernels) / new_tokens, breakdown


def kernel_breakdown(kernels: list[tuple[str, float]], steps: int) -> list[tuple[str, float, float]]:
    """``(name, launches per step, GPU us per step)`` for each kernel name among ``kernels`` (name, device us),
    most launches first: where a step's launches go (logged with the decode rows)."""
    by_name: dict[str, list[float]] = {}
    for name, us in kernels:
        by_name.setdefault(name, []).append(us)
    rows = [(name, len(times) / steps, sum(times) / steps) for name, times in by_name.items()]
    return sorted(rows, key=lambda r: (-r[1], -r[2], r[0]))


def format_breakdown(breakdown: list[tuple[str, float, float]], top: int = 40, width: int = 100) -> str:
    """The first ``top`` rows of a ``kernel_breakdown`` as lines ``launches  us  name`` (names cut to ``width``)."""
    lines = [f"{count:6.1f} {us:8.1f} us  {name[:width]}" for name, count, us in breakdown[:top]]
    if len(breakdown) > top:
        rest = breakdown[top:]
        lines.append(f"{sum(r[1] for r in rest):6.1f} {sum(r[2] for r in rest):8.1f} us  "
                     f"({len(rest)} more kernel names)")
    return "\n".join(lines)


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
            gpu_ms, kernels, breakdown = decode_gpu_time(model, ids, opts.new_tokens, cache)
            rows.append(row(f"{spec.name}_decode", name, "inference", shape, "gpu_time_per_token", "ms",
                            (gpu_ms, gpu_ms, gpu_ms)))
            rows.append(row(f"{spec.name}_decode", name, "inference", shape, "kernels_per_step", "count",
                            (kernels, kernels, kernels)))
            host_ms = decode_host_ms(model, ids, opts.new_tokens, opts.device, cache)
            rows.append(row(f"{spec.name}_decode", name, "inference", shape, "host_time_per_token", "ms",
                            (host_ms, host_ms, host_ms)))
            line += f", GPU {gpu_ms:.3f} ms/token, host {host_ms:.3f} ms/step, {kernels:.0f} kernels/step"
            logger.info("%s decode %s, kernels per step (launches, GPU time, name):\n%s", name, shape,
                        format_breakdown(breakdown))
        logger.info("%s", line)
    return rows, tokens


def _runs_torch_fallback(spec: HybridModel, name: str) -> bool:
    """Whether ``name`` runs HF's memory-hungry torch chunk fallback (its prompts capped at --torch-max-prompt):
    ``hf_eager_torch``, and ``inductor`` where HF did not bind FLA. A model without kernel names has no such
    fallback: its HF eager is the model's own torch code."""
    if not spec.kernel_names:
        return False
    return name == "hf_eager_torch" or (name == "inductor" and not uses_fla(spec))


def _run_configuration(spec: HybridModel, name: str, opts: Options, prompts: dict[int, torch.Tensor],
                       decode_ids: dict):
    """Rows, last-token logits per prompt and the decode tokens (per decode shape) of one configuration."""
    binding = {"hf_eager_fla": "fla", "hf_eager_torch": "torch"}.get(name, "installed")
    short_only = _runs_torch_fallback(spec, name)
    lengths = [T for T in prompts if not short_only or T <= opts.torch_max_prompt]
    shapes = [s for s in opts.decode_shapes if not short_only or s[0] * s[1] <= opts.torch_max_prompt]
    skipped = [T for T in prompts if T not in lengths] + [s for s in opts.decode_shapes if s not in shapes]
    if skipped:
        logger.info("%s: prompts / decode shapes %s skipped (HF's torch fallback; --torch-max-prompt %d)", name,
                    skipped, opts.torch_max_prompt)
    if name in CAPTURED:
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
            if name in ("kda_compile", *CAPTURED):
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


def _prefill_lines(spec: HybridModel, opts: Options, rows: list[dict], ran: list[str], summary: dict) -> list:
    reference = ran[0] if ran else None
    op, lines = f"{spec.name}_prefill", []
    for T in opts.prompts:
        base = _median(rows, op, spec.baseline, f"1x{T}", "time")
        ind = _median(rows, op, "inductor", f"1x{T}", "time")
        for name in ran:
            ms = _median(rows, op, name, f"1x{T}", "time")
            if ms is None:
                continue
            ref = summary["logits"].get(reference, {}).get(T)
            got = summary["logits"][name].get(T)
            err = ("-" if ref is None or got is None or name == reference
                   else f"{((got - ref).norm() / ref.norm()).item():.1e}")
            lines.append([T, name, ms, T / (ms * 1e-3), "-" if base is None else base / ms,
                          "-" if ind is None else ind / ms, err])
    return lines


def _decode_lines(spec: HybridModel, opts: Options, rows: list[dict], ran: list[str], summary: dict) -> list:
    reference = ran[0] if ran else None
    op, lines = f"{spec.name}_decode", []
    for batch, prompt in opts.decode_shapes:
        shape = decode_shape_name(batch, prompt, opts.new_tokens)
        base = _median(rows, op, spec.baseline, shape, "time_per_token")
        ref = summary["tokens"].get(reference, {}).get(shape)
        for name in ran:
            ms = _median(rows, op, name, shape, "time_per_token")
            if ms is None:
                continue
            gpu = _median(rows, op, name, shape, "gpu_time_per_token")
            kernels = _median(rows, op, name, shape, "kernels_per_step")
            host = _median(rows, op, name, shape, "host_time_per_token")
            got = summary["tokens"][name].get(shape)
            same = "-" if ref is None or got is None else f"{sum(a == b for a, b in zip(got, ref))}/{len(ref)}"
            lines.append([shape, name, ms, "-" if gpu is None else gpu, "-" if gpu is None else ms / gpu,
                          "-" if host is None else host, "-" if kernels is None else f"{kernels:.0f}",
                          "-" if base is None else base / ms, same])
    return lines


def print_tables(spec: HybridModel, opts: Options, rows: list[dict], failures: dict[str, str], summary: dict) -> None:
    """The prefill table (when prompts were measured) and the decode table, speedups against the model's
    baseline, agreement against the first configuration that ran."""
    ran = [c for c in opts.configs if c not in failures]
    reference = ran[0] if ran else None
    heading = (f"{spec.title}-shaped, {opts.layers} layers {spec.describe_layers(opts.layers)}, hidden "
               f"{opts.shape.hidden}, {str(opts.dtype).replace('torch.', '')}")
    decode = (f"Decode: {opts.new_tokens} greedy single-token forwards with the cache after the prompt (batch x "
              f"prompt + new tokens; median of {opts.repeats})")
    if opts.prompts:
        print(f"\n{heading}, batch 1: prefill (median; logits_to_keep=1)")
        print(format_table(["prompt", "configuration", "ms", "tokens/s", f"x vs {spec.baseline}", "x vs inductor",
                            f"rel. err vs {reference}"], _prefill_lines(spec, opts, rows, ran, summary)))
        print(f"\n{decode}")
    else:
        print(f"\n{heading}. {decode}")
    print(format_table(["shape", "configuration", "ms per token", "GPU ms per token", "wall / GPU",
                        "host ms per step", "kernels per step",
                        f"x vs {spec.baseline}", f"tokens equal to {reference}"],
                       _decode_lines(spec, opts, rows, ran, summary)))
    for name, why in failures.items():
        print(f"\nFAILED {name}: {why}")


def options_from_args(spec: HybridModel, args) -> Options:
    """The GPU run's options from the command line: the released widths, the model's default prompts and every
    configuration unless ``--prompts`` / ``--configs`` say otherwise."""
    return Options(shape=spec.shape, layers=args.layers or 4, prompts=parse_prompts(args.prompts, spec.prompts),
                   decode_shapes=parse_decode_shapes(args.decode_shapes or DEFAULT_DECODE_SHAPES),
                   new_tokens=args.new_tokens, repeats=args.decode_repeats, torch_max_prompt=args.torch_max_prompt,
                   mode=args.compile_mode, configs=parse_configs(args.configs, spec))


def smoke_from_args(spec: HybridModel, args) -> Options:
    """``smoke_options``, narrowed by ``--configs``, ``--prompts`` and ``--decode-shapes`` where given (a quicker
    check of fewer configurations or shapes); widths, device, dtype and loop lengths stay the smoke run's."""
    given = {}
    if args.configs is not None:
        given["configs"] = parse_configs(args.configs, spec)
    if args.prompts is not None:
        given["prompts"] = parse_prompts(args.prompts, ())
    if args.decode_shapes is not None:
        given["decode_shapes"] = parse_decode_shapes(args.decode_shapes)
    return dataclasses.replace(smoke_options(spec), **given)


def run(spec: HybridModel, args) -> list[dict]:
    """The CLI entry for one model: ``--smoke`` runs ``smoke_from_args`` (tiny widths on CPU), else the released
    widths on CUDA."""
    if args.smoke:
        smoke = smoke_from_args(spec, args)
        rows, failures, summary = measure(spec, smoke)
        print_tables(spec, smoke, rows, failures, summary)
        return rows
    opts = options_from_args(spec, args)
    if not torch.cuda.is_available():
        raise SystemExit(f"the {spec.title} end-to-end benchmark needs a CUDA device (--smoke runs a tiny CPU check)")
    if spec.kernel_names:
        logger.info("HF's %s functions are bound to %s", spec.title, bound_implementation(spec))
    rows, failures, summary = measure(spec, opts)
    print_tables(spec, opts, rows, failures, summary)
    return rows
