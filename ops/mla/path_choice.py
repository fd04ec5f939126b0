"""Which form serves an MLA call: absorbed MQA over the latent cache, or expansion + MHA.

Both forms compute the same function (docs/mla.md §3); they differ only in cost. Notation: B batch,
H query heads, Sq queries, T cached tokens, R = kv_lora_rank (512), Dn / Dr / Dv = nope / rope /
value head dims (128 / 64 / 128), e = bytes per element, P = (query, key) pairs visited per head
(Sq * T, less the causal triangle).

- absorbed: ``q_lat = q_nope @ W_UK`` then MQA with d_qk = R + Dr, d_v = R over the latent, then
  ``@ W_UV^T``. FLOPs ``2*B*H*P*(2R + Dr) + 2*B*Sq*H*R*(Dn + Dv)``; bytes: the latent cache once
  (shared by every head) plus ``kv_b_proj``'s weight.
- expanded: ``kv_b_proj`` over all T cached tokens (``2*B*T*H*R*(Dn + Dv)`` FLOPs, independent of
  Sq), then MHA with d_qk = Dn + Dr, d_v = Dv (``2*B*H*P*(Dn + Dr + Dv)``); bytes add the expanded
  K/V written and read back (``B*T*H*(3Dn + 2Dr + 2Dv)*e``).

Per pair and head the absorbed form costs 2(2R + Dr) = 2176 FLOPs against 640, but it skips the
expansion: 262144 FLOPs and ~1.5 KB of K/V traffic per cached token and head. So it wins while the
query is short next to the cache: decode and speculative steps always, a chunk against a long cache
below about 170 queries, a fresh causal prompt below about 190 tokens (with the constants below;
the crossover does not depend on H or B, which scale both forms alike).

Time estimate: ``flops / (PEAK_FLOPS * efficiency) + bytes / BANDWIDTH``; the rule takes the
smaller. It is a kernel menu (ops/_kernel_choice.py, :data:`FORMS`): the absorbed form first, ``costlier`` where
the estimate says the expanded one is faster; neither form is a fallback of the other. Constants are those of the GPU docs/mla.md §4 names; only their ratios matter. The efficiencies are
what each kernel reaches when compute-bound: cuDNN/flash MHA ~0.55 (at 192/128, docs/mla.md §6), cuBLAS
matmuls ~0.75, our Triton absorbed kernel ~0.35 (d_qk 576 tiles); recalibrate
them with ``python -m kda_compile.bench mla --modes crossover`` on the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

from kda_compile.ops._kernel_choice import Kernel, KernelMenu

PEAK_FLOPS = 990e12  # dense bf16, the datasheet's (docs/mla.md §4)
BANDWIDTH = 3.0e12  # a device-to-device copy's (docs/mla.md §4)
MATMUL_EFFICIENCY = 0.75
EXPANDED_ATTENTION_EFFICIENCY = 0.55
ABSORBED_ATTENTION_EFFICIENCY = 0.35

PATHS = ("auto", "absorbed", "expanded")


@dataclass(frozen=True)
class MLAShape:
    """Sizes of one MLA call (element_bytes: 2 for bf16/fp16, 4 for fp32)."""

    batch: int
    heads: int
    queries: int  # Sq
    cache_len: int  # T
    nope_dim: int  # Dn
    rope_dim: int  # Dr
    value_dim: int  # Dv
    latent_dim: int  # R
    is_causal: bool = False
    element_bytes: int = 2


@dataclass(frozen=True)
class PathCost:
    """Estimated seconds of each form on the reference GPU."""

    absorbed_s: float
    expanded_s: float

    @property
    def best(self) -> str:
        return "absorbed" if self.absorbed_s <= self.expanded_s else "expanded"


def attended_pairs(queries: int, cache_len: int, is_causal: bool) -> int:
    """Number of (query, key) pairs per head. Causal rows are bottom-right aligned: query i sees
    keys ``j <= T - Sq + i``, so row i sees ``max(0, T - Sq + 1 + i)`` keys."""
    if not is_causal:
        return queries * cache_len
    first = max(1, cache_len - queries + 1)  # keys seen by the first row that sees any
    return (first + cache_len) * (cache_len - first + 1) // 2


def estimate(shape: MLAShape) -> PathCost:
    """Estimated time of the absorbed and the expanded form (see the module docstring)."""
    s = shape
    pairs = s.batch * s.heads * attended_pairs(s.queries, s.cache_len, s.is_causal)
    e = s.element_bytes
    latent_bytes = s.batch * s.cache_len * (s.latent_dim + s.rope_dim) * e
    weight_bytes = s.heads * (s.nope_dim + s.value_dim) * s.latent_dim * e
    query_bytes = s.batch * s.queries * s.heads * (s.nope_dim + s.rope_dim + s.value_dim) * e

    absorbed_attention = 2.0 * pairs * (2 * s.latent_dim + s.rope_dim)
    absorption = 2.0 * s.batch * s.queries * s.heads * s.latent_dim * (s.nope_dim + s.value_dim)
    absorbed = (absorbed_attention / (PEAK_FLOPS * ABSORBED_ATTENTION_EFFICIENCY)
                + absorption / (PEAK_FLOPS * MATMUL_EFFICIENCY)
                + (latent_bytes + weight_bytes + query_bytes) / BANDWIDTH)

    expansion = 2.0 * s.batch * s.cache_len * s.heads * s.latent_dim * (s.nope_dim + s.value_dim)
    expanded_attention = 2.0 * pairs * (s.nope_dim + s.rope_dim + s.value_dim)
    expanded_bytes = s.batch * s.cache_len * s.heads * (3 * s.nope_dim + 2 * s.rope_dim + 2 * s.value_dim) * e
    expanded = (expansion / (PEAK_FLOPS * MATMUL_EFFICIENCY)
                + expanded_attention / (PEAK_FLOPS * EXPANDED_ATTENTION_EFFICIENCY)
                + (latent_bytes + weight_bytes + query_bytes + expanded_bytes) / BANDWIDTH)
    return PathCost(absorbed, expanded)


def _estimate_text(cost: PathCost, shape: MLAShape) -> str:
    return (f"estimated absorbed {cost.absorbed_s * 1e6:.1f} us vs expanded {cost.expanded_s * 1e6:.1f} us "
            f"(Sq={shape.queries}, T={shape.cache_len}, H={shape.heads})")


def _absorbed_costlier(shape: MLAShape) -> str | None:
    cost = estimate(shape)
    return None if cost.best == "absorbed" else _estimate_text(cost, shape)


FORMS = KernelMenu("mla_attention", (
    Kernel("absorbed", "absorbed form (MQA over the latent cache)", costlier=_absorbed_costlier),
    Kernel("expanded", "expanded form (kv_b_proj over the cache, then attention)"),
))


def choose_form(requested: str, shape: MLAShape) -> str:
    """The form a call runs: ``requested`` unless it is "auto", else the cheaper one by :func:`estimate`
    (:data:`FORMS`). What every op call asks: no reason is put in words."""
    return FORMS.choose(shape, requested=requested).name


def choose_path(requested: str, shape: MLAShape) -> tuple[str, str]:
    """(path, why): :func:`choose_form`'s form and the reason in words (explain functions, the rewrite)."""
    form = choose_form(requested, shape)
    if requested != "auto":
        return form, f"path={requested!r} was requested"
    return form, _estimate_text(estimate(shape), shape)
