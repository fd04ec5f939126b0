"""The KDA prefill comparison (``python -m kda_compile.bench kda --modes prefill``): its shapes,
inputs, the three providers, each called with the same math, and the timing loop (``bench_comparison``).

Every provider computes, per call, the forward of bf16 q / k / v / g ``[B, T, H, 128]`` and beta ``[B, T, H]``
with q / k L2-normalised, the gate and beta's sigmoid inside the op, ``scale = 128 ** -0.5``, an fp32 initial
state in the value-first layout ``[N, H, V, K]`` (FlashKDA's) and the final state returned:

- ``ours``: ``kda_compile.ops.chunk_kda`` as it chooses its backend (no forcing);
- ``FLA``: flash-linear-attention's public ``chunk_kda`` with the same arguments, on FLA's own kernels: fla-core
  0.6 hands ``chunk_kda`` to FlashKDA whenever ``flash_kda`` is importable and ``safe_gate=True`` (its backend
  dispatch, switched per call by ``FLA_FLASH_KDA``), so this provider sets ``FLA_FLASH_KDA=0``;
- ``FlashKDA``: ``flash_kda.fwd`` (MoonshotAI/FlashKDA, built by ``.ci/flashkda_build.sh``; never vendored),
  lower-bound gate only, with the output and final-state buffers its API wants allocated inside the call.
  Skipped, with the reason logged, when ``import flash_kda`` fails.

Gates: ``lower_bound``: ``g = -5 * sigmoid(exp(A_log) * (g + dt_bias))`` with ``safe_gate`` (FlashKDA's
only gate); ``softplus``: ``g = -exp(A_log) * softplus(g + dt_bias)`` (the released Kimi-Linear's);
``softplus_strong``: the softplus gate with Mamba-style ``exp(A_log) ~ U(1, 16)`` (``strong_a_log``), whose
decays are strong enough that most 16-token blocks span more than 2^120 in some channel (the data that made the
Triton prepare's exact-diagonal pass cost 1.9x): the same data for every provider, to show the speed does not
depend on it.

Shapes (``Shape``): ``BxTxH`` is B sequences of T tokens as a ``[B, T, H, K]`` batch; ``varlen:NxTxH`` is N
sequences of T tokens packed in one ``B = 1`` call with ``cu_seqlens``; ``varlen:L1+L2+...xH`` packs
sequences of the given lengths (zero allowed).
"""
from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass

import torch

from kda_compile.bench.common import QUANTILES, kernel_times, rel_error, row, wall_time_quantiles

logger = logging.getLogger("kda_compile.bench.kda")

K = V = 128
GATES = ("lower_bound", "softplus", "softplus_strong")
LOWER_BOUND = -5.0
PROVIDERS = ("ours", "FLA", "FlashKDA")
# --rounds default: every provider's wall time and kernel profile 3 times per shape and gate; the whole
# comparison (2 gates, 15 shapes) then takes about 5 minutes on an H100 with FLA's autotuning cold
COMPARISON_ROUNDS = 3
# The mixed-length set: 8192 tokens in six sequences, one empty and one of a single token, the others not
# multiples of the 64-token chunk (3000 = 46 chunks + 56, 517, 2626) but one (2048).
MIXED_LENGTHS = (3000, 1, 0, 517, 2048, 2626)


@dataclass(frozen=True)
class Shape:
    """``B`` sequences of ``T`` tokens and ``H`` heads; with ``lengths`` (varlen) ``B = 1`` and ``T`` is the
    packed total."""

    B: int
    T: int
    H: int
    lengths: tuple[int, ...] | None = None

    @property
    def varlen(self) -> bool:
        return self.lengths is not None

    @property
    def num_sequences(self) -> int:
        return len(self.lengths) if self.varlen else self.B

    @property
    def label(self) -> str:
        if not self.varlen:
            return f"{self.B}x{self.T}x{self.H}"
        if len(set(self.lengths)) == 1:
            return f"varlen:{len(self.lengths)}x{self.lengths[0]}x{self.H}"
        return f"varlen:{'+'.join(map(str, self.lengths))}x{self.H}"

    def offsets(self) -> list[int] | None:
        """``cu_seqlens`` as a list (None for a batch): 0, then the running sum of the lengths."""
        if not self.varlen:
            return None
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return out

    @staticmethod
    def packed(lengths, H: int) -> "Shape":
        lengths = tuple(int(n) for n in lengths)
        return Shape(1, sum(lengths), H, lengths)


def issue_shapes() -> list[Shape]:
    """The 15 comparison shapes: 7 batched, 8 packed (the last of mixed lengths)."""
    batched = [Shape(1, 2048, 32), Shape(1, 8192, 32), Shape(1, 8192, 64), Shape(1, 8192, 96),
               Shape(1, 32768, 32), Shape(1, 65536, 16), Shape(8, 4096, 32)]
    packed = [Shape.packed([T] * N, H) for N, T, H in
              ((4, 512, 32), (8, 1024, 32), (8, 1024, 64), (8, 1024, 96), (16, 2048, 32), (64, 256, 32),
               (256, 128, 16))]
    return batched + packed + [Shape.packed(MIXED_LENGTHS, 32)]


SHAPES_HELP = ("BxTxH (B sequences of T tokens as a batch), varlen:NxTxH (N sequences of T tokens packed in one "
               "B = 1 call) or varlen:L1+L2+...xH (packed sequences of these lengths; 0 allowed)")


def _parse_shape(item: str) -> Shape | None:
    varlen = item.startswith("varlen:")
    parts = item.removeprefix("varlen:").split("x")
    if varlen and len(parts) == 2:  # explicit lengths
        lengths, H = parts[0].split("+"), parts[1]
        if not all(n.isdigit() for n in lengths + [H]) or int(H) == 0 or sum(map(int, lengths)) == 0:
            return None
        return Shape.packed(map(int, lengths), int(H))
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        return None
    a, T, H = map(int, parts)
    return Shape.packed([T] * a, H) if varlen else Shape(a, T, H)


def parse_shapes(text: str) -> list[Shape]:
    """``"1x8192x32,varlen:8x1024x64,varlen:5+0+1x16"`` -> shapes (the ``--shapes`` option)."""
    shapes = []
    for raw in text.split(","):
        shape = _parse_shape(raw.strip().lower())
        if shape is None:
            raise argparse.ArgumentTypeError(
                f"shapes must be BxTxH items of positive integers, or varlen:NxTxH, or varlen:L1+L2+...xH "
                f"(lengths may be 0 but not all), separated by commas; got {raw.strip()!r}")
        shapes.append(shape)
    return shapes


@dataclass
class Inputs:
    """One call's tensors (``dt_bias`` flat ``[H * K]``; ``h0`` fp32 ``[N, H, V, K]``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    h0: torch.Tensor
    cu_seqlens: torch.Tensor | None
    cu_seqlens_cpu: torch.Tensor | None
    scale: float = K ** -0.5


def strong_a_log(A_log: torch.Tensor) -> torch.Tensor:
    """``softplus_strong``'s ``A_log`` from the benchmark's ``A_log ~ U(0, 1)``: ``exp`` of it ~ U(1, 16)."""
    return torch.log1p(15 * A_log)


def make_inputs(shape: Shape, device, *, seed: int = 0) -> Inputs:
    """Random inputs for ``shape``, drawn on ``device`` (the gate form is an argument, not data)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    B, T, H = shape.B, shape.T, shape.H

    def randn(*size, dtype=torch.bfloat16, std=1.0):
        return torch.randn(*size, generator=gen, device=device, dtype=dtype) * std

    offsets = shape.offsets()
    A_log = torch.rand(H, generator=gen, device=device)
    return Inputs(q=randn(B, T, H, K), k=randn(B, T, H, K), v=randn(B, T, H, V), g=randn(B, T, H, K),
                  beta=randn(B, T, H), A_log=A_log,
                  dt_bias=randn(H * K, dtype=torch.float32, std=0.1),
                  h0=randn(shape.num_sequences, H, V, K, dtype=torch.float32, std=0.1),
                  cu_seqlens=None if offsets is None else torch.tensor(offsets, dtype=torch.int64, device=device),
                  cu_seqlens_cpu=None if offsets is None else torch.tensor(offsets, dtype=torch.int64))


def chunk_kda_kwargs(x: Inputs, gate: str) -> dict:
    """The keyword arguments ours and FLA's ``chunk_kda`` take for this comparison (same signature)."""
    kwargs = dict(scale=x.scale, initial_state=x.h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True,
                  cu_seqlens=x.cu_seqlens, cu_seqlens_cpu=x.cu_seqlens_cpu, A_log=x.A_log, dt_bias=x.dt_bias)
    if gate == "lower_bound":
        kwargs.update(lower_bound=LOWER_BOUND, safe_gate=True)
    elif gate == "softplus_strong":
        kwargs.update(A_log=strong_a_log(x.A_log))
    elif gate != "softplus":
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    return kwargs


def _chunk_call(chunk_kda, x: Inputs, gate: str):
    kwargs = chunk_kda_kwargs(x, gate)

    def call():
        with torch.inference_mode():
            return chunk_kda(x.q, x.k, x.v, x.g, x.beta, **kwargs)
    return call


def ours_call(x: Inputs, gate: str):
    from kda_compile.ops import chunk_kda

    return _chunk_call(chunk_kda, x, gate)


def fla_call(x: Inputs, gate: str):
    from fla.ops.kda import chunk_kda

    os.environ["FLA_FLASH_KDA"] = "0"  # FLA's own kernels, not its dispatch to FlashKDA (module docstring)
    return _chunk_call(chunk_kda, x, gate)


def flashkda_call(x: Inputs, gate: str):
    """``flash_kda.fwd`` on the same inputs: beta as logits, ``dt_bias`` viewed ``[H, K]``, int64
    ``cu_seqlens`` with ``B = 1``, the fp32 state (it computes in bf16) in and out."""
    import flash_kda

    if gate != "lower_bound":
        raise ValueError(f"FlashKDA implements only the lower-bound gate, not {gate!r}")
    H = x.q.shape[2]
    dt_bias = x.dt_bias.view(H, K)

    def call():
        with torch.inference_mode():
            out = torch.empty_like(x.v)
            final = torch.empty_like(x.h0)
            flash_kda.fwd(x.q, x.k, x.v, x.g, x.beta, x.scale, out, x.A_log, dt_bias, LOWER_BOUND,
                          initial_state=x.h0, final_state=final, cu_seqlens=x.cu_seqlens)
            return out, final
    return call


def flashkda_missing() -> str | None:
    """Why the FlashKDA provider cannot run here (None when ``import flash_kda`` works)."""
    try:
        import flash_kda  # noqa: F401
    except Exception as exc:  # ImportError, or a build that does not load (e.g. another torch's ABI)
        return f"not installed: import flash_kda failed ({type(exc).__name__}: {exc}); build it with " \
               ".ci/flashkda_build.sh"
    return None


def fla_missing() -> str | None:
    try:
        import fla.ops.kda  # noqa: F401
    except Exception as exc:
        return f"not installed: import fla.ops.kda failed ({type(exc).__name__}: {exc})"
    return None


CALLS = {"ours": ours_call, "FLA": fla_call, "FlashKDA": flashkda_call}


def skip_reasons(gate: str, missing=None, selected=PROVIDERS) -> dict[str, str]:
    """provider -> why it does not run for ``gate`` (providers that run are absent). ``missing`` maps a
    provider to its availability check (default: FLA and FlashKDA import checks); ``selected`` are the
    providers asked for (``--providers``), the others are skipped as not selected."""
    missing = missing if missing is not None else {"FLA": fla_missing, "FlashKDA": flashkda_missing}
    reasons = {}
    for name in PROVIDERS:
        if name not in selected:
            reasons[name] = "not selected: --providers"
            continue
        if name == "FlashKDA" and gate != "lower_bound":
            reasons[name] = "n/a: lower-bound gate only"
            continue
        check = missing.get(name)
        why = check() if check is not None else None
        if why:
            reasons[name] = why
    return reasons


def _spread(values: list[float]) -> tuple[float, float, float]:
    """p20 / p50 / p80 of a few values (one per round)."""
    t = torch.tensor(values, dtype=torch.float64)
    return tuple(torch.quantile(t, torch.tensor(QUANTILES, dtype=torch.float64)).tolist())


def _log_ours_backend(gate: str, device) -> None:
    """Which backend ``ours`` (the op's own choice) runs on for this gate."""
    from kda_compile.ops.kda.backends.registry import KDAOptions, select_backend

    lower = gate == "lower_bound"
    opts = KDAOptions(scale=K ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND if lower else None,
                      safe_gate=lower)
    chosen = select_backend("chunk_kda", torch.device(device), torch.bfloat16, K, V, opts)
    logger.info("%s gate: ours runs on the %s backend", gate, chosen.name)


def bench_comparison(gates, shapes, device, rows, *, rounds=COMPARISON_ROUNDS, checkpoint=lambda: None,
                     profile=False, calls=None, missing=None, selected=PROVIDERS) -> dict[str, list[list]]:
    """The comparison (``--modes prefill``): per gate and shape, every provider that runs
    (``skip_reasons``) is called once (compiling and autotuning; its output checked against
    ours), then timed in ``rounds`` interleaved rounds, each a ``wall_time_quantiles`` and a
    ``kernel_times`` profile per provider (wall-time quantiles: the median over the rounds; kernel time:
    the quantiles of the rounds' per-call sums). A provider that raises is logged and left out of that
    shape. ``calls`` / ``missing`` replace ``kda_providers.CALLS`` and its availability checks (tests);
    ``selected`` limits the providers (``--providers``).
    Returns the table lines per gate."""
    import statistics
    import time

    calls = calls or CALLS
    tables = {}
    for gate in gates:
        skipped = skip_reasons(gate, missing, selected)
        for name, why in skipped.items():  # INFO: .ci/gpu drops WARNING lines from its log
            logger.info("%s gate: provider %s skipped: %s", gate, name, why)
        if device == "cuda":
            _log_ours_backend(gate, device)
        lines = tables.setdefault(gate, [])
        for shape in shapes:
            status = {name: ("not installed" if why.startswith("not installed") else why.split(":")[0])
                      for name, why in skipped.items()}
            x = make_inputs(shape, device)
            fns, outputs, started = {}, {}, time.perf_counter()
            for name in (n for n in PROVIDERS if n not in skipped):
                try:
                    fn = calls[name](x, gate)
                    outputs[name] = fn()  # compiles and autotunes before timing
                    fns[name] = fn
                except Exception:
                    logger.exception("%s gate, %s: provider %s failed", gate, shape.label, name)
                    status[name] = "failed"
            errors = {}
            for name in (n for n in outputs if n != "ours" and "ours" in outputs):
                o, final = outputs[name]
                errors[name] = rel_error(o, outputs["ours"][0])
                for metric, value in (("rel_error_vs_ours", errors[name]),
                                      ("final_state_rel_error_vs_ours", rel_error(final, outputs["ours"][1]))):
                    rows.append(row("chunk_kda", name, "fwd", shape.label, metric, "1", (value,) * 3, gate=gate))
            del outputs
            first_s, started = time.perf_counter() - started, time.perf_counter()
            wall, kernel, launches = ({name: [] for name in fns} for _ in range(3))
            for _ in range(rounds):
                for name, fn in fns.items():
                    wall[name].append(wall_time_quantiles(fn, device=device))
                    kernels = kernel_times(fn, device_type=device)
                    kernel[name].append(sum(ms for _, _, ms in kernels))
                    launches[name].append(sum(n for _, n, _ in kernels))
            med = {}
            for name in fns:
                quantiles = tuple(statistics.median(q) for q in zip(*wall[name]))
                med[name] = (quantiles[1], statistics.median(kernel[name]), statistics.median(launches[name]))
                rows.append(row("chunk_kda", name, "fwd", shape.label, "wall_time", "ms", quantiles, gate=gate))
                rows.append(row("chunk_kda", name, "fwd", shape.label, "kernel_time", "ms", _spread(kernel[name]),
                                gate=gate))
                rows.append(row("chunk_kda", name, "fwd", shape.label, "launches", "1", _spread(launches[name]),
                                gate=gate))
                if profile:  # the per-kernel breakdown, one more profile
                    record_kernel_times(fns[name], name, "fwd", shape.label, gate, rows)
            lines.append(_comparison_line(shape.label, med, status, errors))
            logger.info("%s gate, %s: %s (first calls %.1f s, timing %.1f s)", gate, shape.label, "; ".join(
                f"{n} wall {m[0]:.3f} ms, kernels {m[1]:.3f} ms x{m[2]:.0f}" for n, m in med.items()),
                first_s, time.perf_counter() - started)
            del x, fns
            if device == "cuda":
                torch.cuda.empty_cache()
            checkpoint()
    return tables


COMPARISON_HEADERS = ([
    "shape", *(f"{p} wall" for p in PROVIDERS), "FLA/ours wall", "FlashKDA/ours wall",
    *(f"{p} kernels" for p in PROVIDERS), "FLA/ours kernels", "FlashKDA/ours kernels",
    "launches ours/FLA/FlashKDA", "rel. err vs ours: FLA, FlashKDA"])


def _comparison_line(label, med, status, errors) -> list:
    """One table line: medians (ms) and ratios for both metrics; a provider that did not run shows why."""
    def cell(name, i):
        return med[name][i] if name in med else status.get(name, "-")

    def ratio(name, i):
        return med[name][i] / med["ours"][i] if name in med and "ours" in med and med["ours"][i] > 0 else "-"

    line = [label]
    for i in (0, 1):
        line += [cell(p, i) for p in PROVIDERS] + [ratio("FLA", i), ratio("FlashKDA", i)]
    line.append(" / ".join(f"{med[p][2]:.0f}" if p in med else "-" for p in PROVIDERS))
    line.append(", ".join(f"{errors[p]:.1e}" if p in errors else "-" for p in ("FLA", "FlashKDA")))
    return line


def record_kernel_times(fn, provider, mode, shape, gate, rows) -> None:
    """Rows ``kernel_time: <kernel>`` (ms per call) for one provider, and the breakdown in the log."""
    kernels = kernel_times(fn)
    total = sum(ms for _, _, ms in kernels)
    for kernel, launches, ms in kernels:
        rows.append(row("chunk_kda", provider, mode, shape, f"kernel_time: {kernel}", "ms", (ms, ms, ms), gate=gate))
    share = 100 / total if total > 0 else 0.0  # (no kernel recorded: a profiler without CUDA activity)
    lines = [f"  {ms:8.3f} ms {share * ms:5.1f}%  x{launches:<3d} {kernel[:100]}" for kernel, launches, ms in kernels]
    logger.info("%s %s, %s: %.3f ms of kernels per call\n%s", mode, shape, provider, total, "\n".join(lines))
