"""Training steps end to end (``python -m kda_compile.bench e2e --model kimi_linear | qwen3_next --train``).

The models of the end-to-end benchmark (``e2e_hybrid.HybridModel``: released widths, ``--layers`` layers, random
weights, bf16) in training mode, batch 1, one sequence of T tokens per step (``--train-tokens``, default 2k and
8k). A step is what a training loop runs on the model: the forward with ``labels=input_ids`` (HF's shifted
cross-entropy, ``use_cache=False``), then ``loss.backward()`` into the parameters' ``.grad`` (set to None before
each step). The optimizer's update is left out: it is the same elementwise pass over the parameters in every
configuration and would only add a constant.

Configurations: the model's HF eager baselines (``hf_eager_fla``: HF's functions bound to flash-linear-attention,
forward and backward FLA's; ``hf_eager_torch``; ``hf_eager`` for a model without FLA kernels) and
``kda_compile`` (``kda_compile.optimize(model)``, Inductor). Each (configuration, T) runs in its own fresh process
whose Triton, Inductor and NVRTC caches are empty folders, as on a fresh machine:

- ``first_step_time`` (s): the first step from an idle GPU to its end, compiling, autotuning and running (the
  model's construction is outside it);
- ``time_per_step`` (ms): a step as the loop waits for it (``common.wall_time_quantiles``: the device
  synchronised before each), p20 / p50 / p80 over ``--train-steps`` steps after its untimed ones;
- ``gpu_time_per_step`` (ms): the summed GPU time of one step's kernels (torch.profiler);
- ``peak_memory`` (GiB): ``torch.cuda.max_memory_allocated`` over one step after the warm-up (weights included).

The loss and the gradients' global norm of the first step are compared with the baseline's (same weights, same
tokens) in the printed table. ``--smoke`` runs the tiny widths on the CPU in float32 with kda_compile on
``aot_eager``, in this process: it checks the wiring, not the speed (its first step is not a fresh process's).
"""
from __future__ import annotations

import functools
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from kda_compile.bench.common import format_table, kernel_times, row, wall_time_quantiles
from kda_compile.bench.e2e_hybrid import HybridModel, kernel_binding, parse_lengths, synchronize

logger = logging.getLogger("kda_compile.bench.e2e_train")

OURS = "kda_compile"
DEFAULT_TOKENS = (2048, 8192)
RESULT_MARK = "TRAIN_RESULT "
WORKER_TIMEOUT_S = 1800.0
METRICS = (("first_step_time", "s"), ("time_per_step", "ms"), ("gpu_time_per_step", "ms"), ("peak_memory", "GiB"))


@dataclass(frozen=True)
class TrainOptions:
    """One training benchmark run: the widths, layers, step lengths and configurations, the timed steps, the
    device and dtype, kda_compile's compiler, and whether each (configuration, T) gets a fresh process."""

    shape: Any
    layers: int = 4
    tokens: tuple[int, ...] = DEFAULT_TOKENS
    configs: tuple[str, ...] = ()
    steps: int = 5
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    compiler: str = "inductor"
    fresh_process: bool = True


def train_configurations(spec: HybridModel) -> tuple[str, ...]:
    """What ``--configs`` may name with ``--train``: the model's HF eager baselines and ``kda_compile``."""
    return spec.baselines + (OURS,)


def parse_train_configs(text: str | None, spec: HybridModel, smoke: bool = False) -> tuple[str, ...]:
    """``--configs`` with ``--train`` (default: the model's baseline and ``kda_compile``; for the CPU smoke run,
    which has no FLA, its last baseline: HF's torch path)."""
    if text is None:
        return (spec.baselines[-1] if smoke else spec.baseline, OURS)
    configs = tuple(c.strip() for c in text.split(","))
    unknown = [c for c in configs if c not in train_configurations(spec)]
    if unknown:
        raise SystemExit(f"--configs with --train for the {spec.title}-shaped model must name configurations among "
                         f"{', '.join(train_configurations(spec))}, got {unknown}")
    return configs


def training_step(model, ids: torch.Tensor) -> torch.Tensor:
    """One step: the forward with the shifted cross-entropy over ``ids`` and its backward; the detached loss."""
    for p in model.parameters():
        p.grad = None
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach()


def gradient_norm(model) -> float:
    """The global L2 norm of the parameters' gradients, in float64."""
    norms = [p.grad.double().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm()) if norms else 0.0


def _build(spec: HybridModel, name: str, opts: TrainOptions):
    import kda_compile

    model = spec.build(opts.shape, opts.layers, opts.device, opts.dtype).train()
    if name == OURS:
        return kda_compile.optimize(model, kda_compile.Config(compiler=opts.compiler))
    return model


def measure_one(spec: HybridModel, name: str, tokens: int, opts: TrainOptions) -> dict:
    """The metrics of one configuration at one step length, in this process: ``{"first_step_time": s,
    "time_per_step": (p20, p50, p80) ms, "gpu_time_per_step": ms, "peak_memory": GiB, "loss": ..., "grad_norm":
    ...}`` (the GPU-only metrics None on the CPU)."""
    binding = {"hf_eager_fla": "fla", "hf_eager_torch": "torch"}.get(name, "installed")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, opts.shape.vocab, (1, tokens), generator=gen).to(opts.device)
    with kernel_binding(spec, binding):
        model = _build(spec, name, opts)
        synchronize(opts.device)
        start = time.perf_counter()
        loss = training_step(model, ids)
        synchronize(opts.device)
        result = {"first_step_time": time.perf_counter() - start, "loss": float(loss),
                  "grad_norm": gradient_norm(model)}
        step = functools.partial(training_step, model, ids)
        result["time_per_step"] = wall_time_quantiles(step, min_reps=opts.steps, max_reps=opts.steps,
                                                      flush_l2=False, device=opts.device)
        result["gpu_time_per_step"] = result["peak_memory"] = None
        if opts.device == "cuda":
            result["gpu_time_per_step"] = sum(ms for _, _, ms in kernel_times(step, calls=1))
            torch.cuda.reset_peak_memory_stats()
            training_step(model, ids)
            torch.cuda.synchronize()
            result["peak_memory"] = torch.cuda.max_memory_allocated() / 2**30
    del model
    gc.collect()
    return result


def _worker_argv(spec: HybridModel, name: str, tokens: int, opts: TrainOptions) -> list[str]:
    job = {"spec": spec.build.__module__, "tiny": opts.shape == spec.tiny, "name": name, "tokens": tokens,
           "layers": opts.layers, "steps": opts.steps, "device": opts.device,
           "dtype": str(opts.dtype).replace("torch.", ""), "compiler": opts.compiler}
    return [sys.executable, "-m", "kda_compile.bench.e2e_train", "--worker", json.dumps(job)]


def measure_in_fresh_process(spec: HybridModel, name: str, tokens: int, opts: TrainOptions,
                             timeout: float = WORKER_TIMEOUT_S) -> dict:
    """``measure_one`` in a new Python process whose Triton, Inductor and NVRTC caches are new empty folders;
    raises RuntimeError with the process's last output line when it fails or runs past ``timeout``."""
    with tempfile.TemporaryDirectory(prefix="kda_train_cold_") as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(cache, "triton"), TRITON_CACHE_AUTOTUNING="0",
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"), KDA_COMPILE_CACHE_DIR=cache)
        try:
            done = subprocess.run(_worker_argv(spec, name, tokens, opts), env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{name} at T={tokens} did not finish within {timeout:.0f} s") from None
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
    raise RuntimeError(f"{name} at T={tokens} failed: " + (lines[-1][:300] if lines else f"exit {done.returncode}"))


def _rows(spec: HybridModel, name: str, tokens: int, result: dict) -> list[dict]:
    rows = []
    for metric, unit in METRICS:
        value = result.get(metric)
        if value is None:
            continue
        quantiles = tuple(value) if isinstance(value, (list, tuple)) else (value,) * 3
        rows.append(row(f"{spec.name}_train", name, "train", f"1x{tokens}", metric, unit, quantiles))
    return rows


def measure(spec: HybridModel, opts: TrainOptions) -> tuple[list[dict], dict, dict]:
    """Every configuration at every step length; returns (CSV rows, results by (name, T), failures by (name, T)).
    A failing configuration (FLA missing, out of memory, a compile error) is recorded; the others still run."""
    rows, results, failures = [], {}, {}
    for tokens in opts.tokens:
        for name in opts.configs:
            try:
                if opts.fresh_process:
                    result = measure_in_fresh_process(spec, name, tokens, opts)
                else:
                    result = measure_one(spec, name, tokens, opts)
            except Exception as exc:  # noqa: BLE001  (record it, run the others)
                failures[(name, tokens)] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                logger.warning("%s at T=%d failed: %s", name, tokens, failures[(name, tokens)])
                continue
            results[(name, tokens)] = result
            rows += _rows(spec, name, tokens, result)
            logger.info("%s T=%d: first step %.1f s, %.2f ms per step", name, tokens, result["first_step_time"],
                        result["time_per_step"][1])
    return rows, results, failures


def _rel(a: float, b: float) -> str:
    return f"{abs(a - b) / max(abs(b), 1e-30):.1e}"


def print_table(spec: HybridModel, opts: TrainOptions, results: dict, failures: dict) -> None:
    baseline = opts.configs[0]
    lines = []
    for (name, tokens), r in results.items():
        base = results.get((baseline, tokens))
        gpu, peak = r["gpu_time_per_step"], r["peak_memory"]
        lines.append([f"1x{tokens}", name, r["time_per_step"][1], "-" if gpu is None else gpu,
                      "-" if peak is None else peak, r["first_step_time"],
                      "-" if base is None else base["time_per_step"][1] / r["time_per_step"][1],
                      "-" if base is None or name == baseline else _rel(r["loss"], base["loss"]),
                      "-" if base is None or name == baseline else _rel(r["grad_norm"], base["grad_norm"])])
    print(f"\n{spec.title}-shaped, {opts.layers} layers, {str(opts.dtype).replace('torch.', '')}, batch 1: training "
          f"step (forward with labels + backward; median of {opts.steps} steps)")
    print(format_table(["shape", "configuration", "ms per step", "GPU ms per step", "peak GiB", "first step s",
                        f"x vs {baseline}", "loss rel. diff", "grad norm rel. diff"], lines))
    for (name, tokens), why in failures.items():
        print(f"\nFAILED {name} at T={tokens}: {why}")


def options_from_args(spec: HybridModel, args) -> TrainOptions:
    """The CLI's options: released widths on CUDA in fresh processes, or with ``--smoke`` the tiny widths on the
    CPU in this process (``--train-tokens`` default 16 there)."""
    configs = parse_train_configs(args.configs, spec, smoke=args.smoke)
    if args.smoke:
        return TrainOptions(shape=spec.tiny, layers=4, tokens=parse_lengths(args.train_tokens, (16,), "--train-tokens", "16"),
                            configs=configs, steps=2, device="cpu", dtype=torch.float32,
                            compiler="aot_eager", fresh_process=False)
    tokens = parse_lengths(args.train_tokens, DEFAULT_TOKENS, "--train-tokens", "2048,8192")
    return TrainOptions(shape=spec.shape, layers=args.layers or 4, tokens=tokens, configs=configs,
                        steps=args.train_steps)


def run(spec: HybridModel, args) -> list[dict]:
    """The CLI entry for one model's training rows."""
    opts = options_from_args(spec, args)
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"the {spec.title} training benchmark needs a CUDA device (--smoke runs a tiny CPU check)")
    rows, results, failures = measure(spec, opts)
    print_table(spec, opts, results, failures)
    return rows


def _worker(job_json: str) -> None:
    import importlib

    job = json.loads(job_json)
    spec = importlib.import_module(job["spec"]).MODEL
    opts = TrainOptions(shape=spec.tiny if job["tiny"] else spec.shape, layers=job["layers"], steps=job["steps"],
                        device=job["device"], dtype=getattr(torch, job["dtype"]),
                        compiler=job["compiler"], fresh_process=False)
    result = measure_one(spec, job["name"], job["tokens"], opts)
    print(RESULT_MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--worker":
        raise SystemExit("usage: python -m kda_compile.bench.e2e_train --worker JOB_JSON (run by the e2e benchmark)")
    _worker(sys.argv[2])
