"""Triton kernel for DSA's sparse attention forward: each query attends to its own gathered top-k keys.

Kernel and launcher only (no torch.compile, no dispatch). One program per (query token, block of heads
of one KV group, slice of the value width). The heads are the MMA's M dimension: in the absorbed MQA form
(Hkv = 1, DeepSeek-V3.2: 128 heads, d_qk = 512 latent + 64 rope, d_v = 512) a program holds up to 128
heads of one token, and every gathered key row serves all of them. The program walks the token's top-k indices
in BLOCK_K chunks: gathered loads of the selected rows (-1 masked), ``s = q . k`` as a power-of-two
"main" part plus a "tail" (576 = 512 + 64: no padding to 1024), an online softmax in base 2, and
``acc += p @ v``. When the value is the first d_v columns of the key row (absorbed form, d_v = the main
width) the main tile already loaded for the scores is reused as the value: each row is read once.

Chunks whose indices are all -1 (the early queries of a causal prefill: query i has at most i + 1 keys)
skip their loads and dots. The accumulator [BLOCK_H, d_v / DV_SPLITS] is float32 in registers: at 128
heads d_v is split over two programs (each recomputes the scores, and then reads the value columns
separately instead of reusing the key tile), which measured faster than 64-head blocks.

Split-K (flash decoding) for small grids. At decode (S = 1) the grid is B x 2 programs at 128 heads: 128
at batch 64 (one per SM on a 132-SM GPU), 2 at batch 1 (130 SMs idle, each program walking all 2048 indices).
With ``topk_splits`` > 1 the token's top-k list is cut into contiguous ranges of whole BLOCK_K chunks, one
program each; a split program writes its own normalised output ``acc / l`` and natural-log lse (-inf for a
split without a valid index) to float32 scratch [B, S, splits, Hq, d_v] and [B, S, splits, Hq], and
``sparse_attention_combine_kernel`` merges them per (token, head): lse = log sum_j exp(lse_j),
o = sum_j exp(lse_j - lse) o_j (o = 0, lse = -inf for a row with no valid index in any split, as unsplit).
The launcher picks the count with a wave model (``choose_topk_splits``): batch 1 decode gets 32 splits, while
prefill and batch-64 decode, whose grids already occupy every SM, stay unsplit and launch as before.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kda_compile.ops._common import cdiv, cuda_index, next_power_of_2, sm_count, triton_interpreted as interpreted

logger = logging.getLogger(__name__)

SHORT_QUERIES = 16  # up to this many queries (decode, short chunks) every chunk is attended, -1 rows masked
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def gather_scores(q_main, q_tail, k_base, idx, valid, offs_dm, dm_ok, offs_dt, dt_ok, stride_kt, stride_kd, D_MAIN,
                  HAS_TAIL: tl.constexpr, PRECISION: tl.constexpr):
    """(rows, k_main, k_tail, s): a chunk's selected key rows gathered (-1 masked to zeros; ``k_tail`` is
    ``k_main`` without a tail) and the raw scores ``q . k`` [BLOCK_H, BLOCK_K] over the main and tail widths."""
    rows = tl.where(valid, idx, 0).to(tl.int64)
    k_main = tl.load(k_base + rows[:, None] * stride_kt + offs_dm[None, :] * stride_kd,
                     mask=valid[:, None] & dm_ok[None, :], other=0.0)
    s = tl.dot(q_main, tl.trans(k_main), input_precision=PRECISION)
    if HAS_TAIL:
        k_tail = tl.load(k_base + rows[:, None] * stride_kt + (D_MAIN + offs_dt[None, :]) * stride_kd,
                         mask=valid[:, None] & dt_ok[None, :], other=0.0)
        s += tl.dot(q_tail, tl.trans(k_tail), input_precision=PRECISION)
    else:
        k_tail = k_main
    return rows, k_main, k_tail, s


@triton.jit
def _attend_chunk(q_main, q_tail, k_base, v_base, idx, valid, offs_dm, dm_ok, offs_dt, dt_ok, offs_dv, dv_ok, dv0,
                  m_i, l_i, acc, qk_scale, stride_kt, stride_kd, stride_vt, stride_vd, D_MAIN,
                  HAS_TAIL: tl.constexpr, SHARED_V: tl.constexpr, PRECISION: tl.constexpr):
    """One BLOCK_K chunk of selected keys (-1 masked): gathered rows, scores, online softmax, ``acc += p @ v``."""
    rows, k_main, k_tail, s = gather_scores(q_main, q_tail, k_base, idx, valid, offs_dm, dm_ok, offs_dt, dt_ok,
                                            stride_kt, stride_kd, D_MAIN, HAS_TAIL, PRECISION)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no inf - inf on rows with nothing yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if SHARED_V:
        acc = acc * alpha[:, None] + tl.dot(p.to(k_main.dtype), k_main, input_precision=PRECISION)
    else:
        v = tl.load(v_base + rows[:, None] * stride_vt + (dv0 + offs_dv[None, :]) * stride_vd,
                    mask=valid[:, None] & dv_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def sparse_attention_fwd_kernel(
    Q, K, V, Idx, Out, Lse,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ib, stride_is, stride_ik,
    stride_ob, stride_os, stride_oj, stride_oh, stride_od,
    stride_lb, stride_ls, stride_lj, stride_lh,
    S, TOPK, GROUPS, D_MAIN, D_TAIL, D_V, DV_PER_PROGRAM, scale,
    NUM_SPLITS, TOPK_PER_SPLIT, HEAD_BLOCKS, DV_SPLITS,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DM: tl.constexpr, BLOCK_DT: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_TAIL: tl.constexpr, SHARED_V: tl.constexpr, SPLIT_K: tl.constexpr,
    SKIP_EMPTY: tl.constexpr, PRECISION: tl.constexpr,
):
    """Out[b, i, (split,) heads, dv slice] and Lse[b, i, (split,) heads] for one token and one head block.

    Q [B, S, Hq, Dqk], K [B, T, Hkv, Dqk], V [B, T, Hkv, *] (with SHARED_V unused: the value is K's main
    tile), Idx [B, S, TOPK] int32, all by strides. Without SPLIT_K: grid (B * S, HEAD_BLOCKS, DV_SPLITS), the
    program walks the whole top-k list and writes Out [B, S, Hq, Dv] (q's dtype) and Lse [B, S, Hq] float32
    (stride_oj / stride_lj unused). With SPLIT_K: grid (B * S * NUM_SPLITS * HEAD_BLOCKS * DV_SPLITS,), the
    value slice varying fastest, then the head block, the split, the token (the programs that gather the same
    rows run side by side, so all but the first read them from L2); split j walks indices
    [j * TOPK_PER_SPLIT, min(TOPK, (j + 1) * TOPK_PER_SPLIT)) and writes its normalised partial output and
    natural-log partial lse (-inf when it saw no valid index) to float32 scratch Out [B, S, NUM_SPLITS, Hq, Dv]
    and Lse [B, S, NUM_SPLITS, Hq], combined by ``sparse_attention_combine_kernel``."""
    if SPLIT_K:
        pid = tl.program_id(0)
        dv_idx = pid % DV_SPLITS
        pid = pid // DV_SPLITS
        head_block = pid % HEAD_BLOCKS
        pid = pid // HEAD_BLOCKS
        split = pid % NUM_SPLITS
        token = pid // NUM_SPLITS
        lo = split * TOPK_PER_SPLIT
        hi = tl.minimum(lo + TOPK_PER_SPLIT, TOPK)
    else:
        token = tl.program_id(0)
        head_block = tl.program_id(1)
        dv_idx = tl.program_id(2)
        split = 0
        lo = 0
        hi = TOPK
    b = (token // S).to(tl.int64)
    i = (token % S).to(tl.int64)
    blocks_per_group = tl.cdiv(GROUPS, BLOCK_H)
    kvh = head_block // blocks_per_group
    in_group = (head_block % blocks_per_group) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = in_group < GROUPS
    heads = kvh * GROUPS + in_group
    dv0 = dv_idx * DV_PER_PROGRAM

    offs_dm = tl.arange(0, BLOCK_DM)
    dm_ok = offs_dm < D_MAIN
    q_base = Q + b * stride_qb + i * stride_qs + heads[:, None] * stride_qh
    q_main = tl.load(q_base + offs_dm[None, :] * stride_qd, mask=h_ok[:, None] & dm_ok[None, :], other=0.0)
    offs_dt = tl.arange(0, BLOCK_DT)
    dt_ok = offs_dt < D_TAIL
    if HAS_TAIL:
        q_tail = tl.load(q_base + (D_MAIN + offs_dt[None, :]) * stride_qd, mask=h_ok[:, None] & dt_ok[None, :],
                         other=0.0)
    else:
        q_tail = q_main  # unused
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = (offs_dv < DV_PER_PROGRAM) & (dv0 + offs_dv < D_V)

    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    i_base = Idx + b * stride_ib + i * stride_is
    qk_scale = scale * LOG2E
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if SHARED_V:
        acc = tl.zeros([BLOCK_H, BLOCK_DM], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        idx = tl.load(i_base + offs_k * stride_ik, mask=offs_k < hi, other=-1)
        valid = idx >= 0
        if SKIP_EMPTY:  # prefill: the early queries' chunks are all -1
            if tl.max(valid.to(tl.int32), 0) > 0:
                m_i, l_i, acc = _attend_chunk(
                    q_main, q_tail, k_base, v_base, idx, valid, offs_dm, dm_ok, offs_dt, dt_ok, offs_dv, dv_ok, dv0,
                    m_i, l_i, acc, qk_scale, stride_kt, stride_kd, stride_vt, stride_vd, D_MAIN,
                    HAS_TAIL, SHARED_V, PRECISION)
        else:  # no branch: the loads of the next chunk can be issued under this chunk's dots
            m_i, l_i, acc = _attend_chunk(
                q_main, q_tail, k_base, v_base, idx, valid, offs_dm, dm_ok, offs_dt, dt_ok, offs_dv, dv_ok, dv0,
                m_i, l_i, acc, qk_scale, stride_kt, stride_kd, stride_vt, stride_vd, D_MAIN,
                HAS_TAIL, SHARED_V, PRECISION)

    alive = l_i > 0
    safe_l = tl.where(alive, l_i, 1.0)
    o = acc / safe_l[:, None]
    o_base = Out + b * stride_ob + i * stride_os + heads[:, None] * stride_oh
    lse_base = Lse + b * stride_lb + i * stride_ls + heads * stride_lh
    if SPLIT_K:
        o_base += split * stride_oj
        lse_base += split * stride_lj
    if SHARED_V:
        tl.store(o_base + offs_dm[None, :] * stride_od, o.to(Out.dtype.element_ty),
                 mask=h_ok[:, None] & (offs_dm < D_V)[None, :])
    else:
        tl.store(o_base + (dv0 + offs_dv[None, :]) * stride_od, o.to(Out.dtype.element_ty),
                 mask=h_ok[:, None] & dv_ok[None, :])
    if dv_idx == 0:
        lse = tl.where(alive, (m_i + tl.log2(safe_l)) * LN2, float("-inf"))
        tl.store(lse_base, lse, mask=h_ok)


@triton.jit
def sparse_attention_combine_kernel(
    OPart, LsePart, Out, Lse,
    stride_pb, stride_ps, stride_pj, stride_ph, stride_pd,
    stride_qb, stride_qs, stride_qj, stride_qh,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_ls, stride_lh,
    S, H, D_V, NUM_SPLITS,
    BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, SPLITS_AT_ONCE: tl.constexpr,
):
    """Merge the split partials of one token, a block of heads and a block of value columns.

    OPart [B, S, NUM_SPLITS, H, D_V] float32 (each split's output normalised by its own exp-sum), LsePart
    [B, S, NUM_SPLITS, H] float32 (natural log, -inf for a split without a valid index), Out [B, S, H, D_V]
    (q's dtype), Lse [B, S, H] float32. lse = log sum_j exp(lse_j), o = sum_j exp(lse_j - lse) o_j; a row
    without a valid index in any split gets o = 0 and lse = -inf. With SPLITS_AT_ONCE every split (BLOCK_J >=
    NUM_SPLITS) is loaded at once, otherwise one split after the other. Grid (B * S, head blocks, value blocks)."""
    token = tl.program_id(0)
    b = (token // S).to(tl.int64)
    i = (token % S).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    offs_dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < D_V
    if SPLITS_AT_ONCE:  # every split's tile in one load: the loads' latency is paid once
        offs_j = tl.arange(0, BLOCK_J)
        j_ok = offs_j < NUM_SPLITS
        lse_parts = tl.load(LsePart + b * stride_qb + i * stride_qs + offs_j[:, None] * stride_qj
                            + heads[None, :] * stride_qh, mask=j_ok[:, None] & h_ok[None, :], other=float("-inf"))
        m = tl.max(lse_parts, 0)
        m_use = tl.where(m == float("-inf"), 0.0, m)  # dead rows: exp(-inf - 0) = 0, never -inf - -inf
        w = tl.exp(lse_parts - m_use[None, :])  # [J, H]
        total = tl.sum(w, 0)
        o_parts = tl.load(OPart + b * stride_pb + i * stride_ps + offs_j[:, None, None] * stride_pj
                          + heads[None, :, None] * stride_ph + offs_dv[None, None, :] * stride_pd,
                          mask=j_ok[:, None, None] & h_ok[None, :, None] & dv_ok[None, None, :], other=0.0)
        acc = tl.sum(w[:, :, None] * o_parts, 0)
    else:  # one split at a time
        lse_base = LsePart + b * stride_qb + i * stride_qs + heads * stride_qh
        o_base = OPart + b * stride_pb + i * stride_ps + heads[:, None] * stride_ph + offs_dv[None, :] * stride_pd
        m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        for j in range(NUM_SPLITS):
            m = tl.maximum(m, tl.load(lse_base + j * stride_qj, mask=h_ok, other=float("-inf")))
        m_use = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        for j in range(NUM_SPLITS):
            w = tl.exp(tl.load(lse_base + j * stride_qj, mask=h_ok, other=float("-inf")) - m_use)
            o_j = tl.load(o_base + j * stride_pj, mask=h_ok[:, None] & dv_ok[None, :], other=0.0)
            total += w
            acc += w[:, None] * o_j
    alive = total > 0
    safe = tl.where(alive, total, 1.0)
    o = acc / safe[:, None]
    tl.store(Out + b * stride_ob + i * stride_os + heads[:, None] * stride_oh + offs_dv[None, :] * stride_od,
             o.to(Out.dtype.element_ty), mask=h_ok[:, None] & dv_ok[None, :])
    if tl.program_id(2) == 0:
        lse = tl.where(alive, m_use + tl.log(safe), float("-inf"))
        tl.store(Lse + b * stride_lb + i * stride_ls + heads * stride_lh, lse, mask=h_ok)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SparseConfig:
    block_h: int  # heads per program (the MMA's M)
    block_k: int  # selected keys per chunk
    dv_splits: int  # programs sharing one (token, head block), each with a slice of d_v
    num_warps: int
    num_stages: int
    # Contiguous ranges of the top-k list, one program each, merged by the combine kernel (split-K, as in
    # flash decoding). None: chosen per call by ``choose_topk_splits`` (1 unless the grid is under two
    # waves, e.g. decode); an int forces that many (capped at the chunk count, normalised so that no split
    # is empty). Forced values are for tests and benchmark sweeps.
    topk_splits: int | None = None

    def __post_init__(self):
        t = self.topk_splits
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(f"SparseConfig.topk_splits must be None (automatic) or an int >= 1, got {t!r}")


def head_widths(d_qk: int) -> tuple[int, int, int, int]:
    """(main width, its block, tail width, its block): the main part is the largest power of two <= d_qk
    (at least one 16-wide MMA block), the tail the rest (576 -> 512 + 64, 192 -> 128 + 64)."""
    main = 1 << (d_qk.bit_length() - 1)
    if main < 16:
        return d_qk, 16, 0, 16
    tail = d_qk - main
    return main, main, tail, max(16, next_power_of_2(tail))


def default_config(groups: int, d_qk: int, d_v: int, dtype: torch.dtype, queries: int = SHORT_QUERIES + 1
                   ) -> SparseConfig:
    """Fixed configs (no autotuning: deterministic launches, and the interpreter cannot tune).

    Prefill (more than ``SHORT_QUERIES`` queries), from the sweep of ``python -m kda_compile.bench dsa
    --modes configs`` (docs/dsa.md, section 4, "Tuning measurements", "sparse attention tiles"): 128 heads per program
    with d_v split over two programs (each gathered key chunk serves 128 heads; the split keeps the [128, 256]
    accumulator in registers) beat 64 heads x 64 keys and 64 x 32. Float32 or smaller groups use smaller head blocks
    (shared memory; at least 16, the MMA's minimum).

    Decode and short chunks attend every chunk without a branch, so the next chunk's gathers are pipelined
    under the current chunk's dots; that needs a stage of shared memory more than 128 heads x 576 leave (254
    KiB), and 64 heads with d_v = 512 whole and the key tile reused as the value (no score recomputation) is
    the faster tile there anyway (docs/dsa.md, section 4, "Tuning measurements", "sparse attention tiles").
    ``topk_splits`` stays None (automatic, ``choose_topk_splits``)."""
    if interpreted():
        return SparseConfig(16, 16, 1, 1, 1)
    wide = max(d_qk, d_v) > 256
    block_h = min(128, max(16, next_power_of_2(groups)))
    if dtype == torch.float32:
        block_h = min(block_h, 32 if wide else 64)
        return SparseConfig(block_h, 16 if wide else 32, 1, 8 if wide else 4, 2)
    if block_h == 128 and wide and queries > SHORT_QUERIES:
        return SparseConfig(128, 32, 2, 8, 2)
    if block_h == 128:
        return SparseConfig(64, 64, 1, 8, 2)
    return SparseConfig(block_h, 64 if block_h >= 32 else 32, 1, 8 if wide else 4, 2)


# The split-K policy's wave model, in units of one BLOCK_K chunk of one program (the gather of 32 rows of 576
# bf16 = 36 KiB and its dots at the DeepSeek-V3.2 decode widths). The wide half-precision configs hold one
# program per SM (a [128, 256] float32 accumulator plus a 128 x 576 query), so programs run in waves of one per
# SM. Calibrated on graph-replayed decode (docs/dsa.md, section 4, "Tuning measurements", "split-K").
RESIDENT_PROGRAMS = 1  # programs resident per SM
PROGRAM_CHUNKS = 2.0  # per program: the query tile load (128 x 576 bf16 = 144 KiB at 128 heads) and epilogue
PARTIAL_CHUNKS = 3.0  # per split program: its float32 partial (128 KiB at 128 heads x 256 columns), and
# the same again spread over the GPU when the combine kernel reads it back
COMBINE_CHUNKS = 1.0  # the combine kernel's launch and its short grid
COMBINE_TILE = 4096  # float32 partials one combine program loads at once (32 a thread at 4 warps)
# Above this many splits the combine loads every split at once; at 4 or 5 splits one split after the other is
# faster (docs/dsa.md, section 4, "Tuning measurements", "split-K").
COMBINE_AT_ONCE_ABOVE = 8
INTERPRETED_SMS = 4  # a pretend SM count on CPU (the interpreter), so small test shapes split


def _device_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETED_SMS
    return sm_count(cuda_index(device))


def effective_splits(splits: int, chunks: int) -> tuple[int, int]:
    """(splits, chunks per split) after capping at the chunk count and dropping empty splits: 3 splits of
    5 chunks -> (3, 2) (2 + 2 + 1), 4 splits of 5 chunks -> (3, 2) as well."""
    chunks = max(1, chunks)
    per = cdiv(chunks, max(1, min(splits, chunks)))
    return cdiv(chunks, per), per


@functools.lru_cache(maxsize=None)
def choose_topk_splits(base_programs: int, chunks: int, sms: int) -> int:
    """Top-k splits for a grid of ``base_programs`` (tokens x head blocks x value slices), ``chunks`` BLOCK_K
    chunks per token, on ``sms`` SMs: the count minimising a wave model of the forward's time (ties to fewer).

    A grid of two waves or more stays unsplit (prefill: 4k tokens x 2 value slices = 8192 programs, the
    launch is exactly the unsplit one). Otherwise, with one resident program per SM,

        cost(s) = waves(s) * (ceil(chunks / s) + PROGRAM_CHUNKS + PARTIAL_CHUNKS [s > 1])
                  + [s > 1] (base * s * PARTIAL_CHUNKS / sms + COMBINE_CHUNKS),  waves(s) = ceil(base * s / sms)

    i.e. splitting pays when it puts idle SMs to work, not for its own sake: it adds a float32 partial per
    program (written and read back), a query tile load per program and a second launch. On 132 SMs with two
    programs per token (DeepSeek-V3.2's 128 heads in two blocks) and 64 chunks: batch 1 -> 32 splits (64
    programs of two chunks), batch 16 -> 4, batch 64 -> 1 (128 programs already hold one SM each: more splits
    only add waves), the choices the measured timings favour; with the decode tile's 32 chunks of 64 keys,
    batch 1 -> 32, batch 16 -> 4, batch 64 -> 1."""
    if chunks <= 1 or base_programs >= 2 * sms * RESIDENT_PROGRAMS:
        return 1
    slots = sms * RESIDENT_PROGRAMS

    def cost(splits: int) -> float:
        per = cdiv(chunks, splits)
        waves = cdiv(base_programs * splits, slots)
        if splits == 1:
            return waves * (per + PROGRAM_CHUNKS)
        return (waves * (per + PROGRAM_CHUNKS + PARTIAL_CHUNKS)
                + base_programs * splits * PARTIAL_CHUNKS / slots + COMBINE_CHUNKS)

    counts = sorted({effective_splits(s, chunks)[0] for s in range(1, chunks + 1)})
    best = min(counts, key=lambda s: (cost(s), s))
    logger.debug("sparse attention forward: %d top-k splits for %d programs x %d chunks on %d SMs",
                 best, base_programs, chunks, sms)
    return best


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def sparse_attention_fwd_triton(q, k, v, indices, scale: float, d_v: int, *, config: SparseConfig | None = None):
    """(o [B, S, Hq, d_v] contiguous in q's dtype, lse [B, S, Hq] float32) of ``dsa_sparse_attention``.

    q [B, S, Hq, Dqk], k [B, T, Hkv, Dqk], v [B, T, Hkv, d_v] or None (value = k[..., :d_v]), indices
    int32 [B, S, topk]; any strides. ``config.topk_splits`` (None: ``choose_topk_splits``) > 1 runs the
    split-K form: float32 partials [B, S, splits, Hq, d_v] and [B, S, splits, Hq], then the combine kernel."""
    b, s_len, hq, d_qk = q.shape
    hkv = k.shape[2]
    groups = hq // hkv
    topk = indices.shape[-1]
    o = torch.empty((b, s_len, hq, d_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, s_len, hq), dtype=torch.float32, device=q.device)
    if b * s_len == 0:
        return o, lse
    cfg = config or default_config(groups, d_qk, d_v, q.dtype, s_len)
    d_main, block_dm, d_tail, block_dt = head_widths(d_qk)
    shared_v = v is None and cfg.dv_splits == 1 and d_v == d_main == block_dm
    dv_per_program = cdiv(d_v, cfg.dv_splits)
    block_dv = max(16, next_power_of_2(dv_per_program))
    value = k if v is None else v
    head_blocks = hkv * cdiv(groups, cfg.block_h)
    chunks = cdiv(topk, cfg.block_k)
    if cfg.topk_splits is None:
        splits = choose_topk_splits(b * s_len * head_blocks * cfg.dv_splits, chunks, _device_sms(q.device))
    else:
        splits = cfg.topk_splits
    splits, chunks_per_split = effective_splits(splits, chunks)
    common = dict(
        BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k, BLOCK_DM=block_dm, BLOCK_DT=block_dt, BLOCK_DV=block_dv,
        HAS_TAIL=d_tail > 0, SHARED_V=shared_v, SPLIT_K=splits > 1, SKIP_EMPTY=s_len > SHORT_QUERIES,
        PRECISION=_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    strides = (*q.stride(), *k.stride(), *value.stride(), *indices.stride())
    if splits == 1:
        grid = (b * s_len, head_blocks, cfg.dv_splits)
        sparse_attention_fwd_kernel[grid](
            q, k, value, indices, o, lse, *strides,
            *o.stride()[:2], 0, *o.stride()[2:], *lse.stride()[:2], 0, lse.stride(2),
            s_len, topk, groups, d_main, d_tail, d_v, dv_per_program, float(scale),
            1, topk, head_blocks, cfg.dv_splits, **common,
        )
        return o, lse
    o_part = torch.empty((b, s_len, splits, hq, d_v), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((b, s_len, splits, hq), dtype=torch.float32, device=q.device)
    grid = (b * s_len * splits * head_blocks * cfg.dv_splits,)
    sparse_attention_fwd_kernel[grid](
        q, k, value, indices, o_part, lse_part, *strides, *o_part.stride(), *lse_part.stride(),
        s_len, topk, groups, d_main, d_tail, d_v, dv_per_program, float(scale),
        splits, chunks_per_split * cfg.block_k, head_blocks, cfg.dv_splits, **common,
    )
    combine_splits(o_part, lse_part, o, lse)
    return o, lse


def combine_splits(o_part, lse_part, o, lse) -> None:
    """``o`` [B, S, Hq, d_v] and ``lse`` [B, S, Hq] from the split partials ``o_part`` [B, S, splits, Hq, d_v] and
    ``lse_part`` [B, S, splits, Hq] (float32; each split normalised by its own exp-sum, natural-log lse, -inf for a
    split without a valid index), any strides: ``sparse_attention_combine_kernel``."""
    b, s_len, splits, hq, d_v = o_part.shape
    at_once = splits > COMBINE_AT_ONCE_ABOVE
    block_j = next_power_of_2(splits) if at_once else 1
    block_dv = min(64, next_power_of_2(d_v))
    # at once: a [splits x heads x columns] load of about COMBINE_TILE floats, fewer heads as the splits grow
    block_h = min(16, next_power_of_2(hq), max(2, COMBINE_TILE // (block_j * block_dv)))
    while block_j * block_h * block_dv > COMBINE_TILE and block_dv > 16:
        block_dv //= 2
    sparse_attention_combine_kernel[(b * s_len, cdiv(hq, block_h), cdiv(d_v, block_dv))](
        o_part, lse_part, o, lse, *o_part.stride(), *lse_part.stride(), *o.stride(), *lse.stride(),
        s_len, hq, d_v, splits, BLOCK_J=block_j, BLOCK_H=block_h, BLOCK_DV=block_dv, SPLITS_AT_ONCE=at_once,
        num_warps=4,
    )
