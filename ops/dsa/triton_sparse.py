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
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kda_compile.ops._common import cdiv, next_power_of_2

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def sparse_attention_fwd_kernel(
    Q, K, V, Idx, Out, Lse,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ib, stride_is, stride_ik,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_ls, stride_lh,
    S, TOPK, GROUPS, D_MAIN, D_TAIL, D_V, DV_PER_PROGRAM, scale,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DM: tl.constexpr, BLOCK_DT: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_TAIL: tl.constexpr, SHARED_V: tl.constexpr, PRECISION: tl.constexpr,
):
    """Out[b, i, heads, dv slice] and Lse[b, i, heads] for one token and one head block.

    Q [B, S, Hq, Dqk], K [B, T, Hkv, Dqk], V [B, T, Hkv, *] (with SHARED_V unused: the value is K's main
    tile), Idx [B, S, TOPK] int32, Out [B, S, Hq, Dv], Lse [B, S, Hq] float32; all by strides.
    Grid (B * S, Hkv * head blocks per group, value slices)."""
    token = tl.program_id(0)
    b = (token // S).to(tl.int64)
    i = (token % S).to(tl.int64)
    blocks_per_group = tl.cdiv(GROUPS, BLOCK_H)
    kvh = tl.program_id(1) // blocks_per_group
    in_group = (tl.program_id(1) % blocks_per_group) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = in_group < GROUPS
    heads = kvh * GROUPS + in_group
    dv0 = tl.program_id(2) * DV_PER_PROGRAM

    offs_dm = tl.arange(0, BLOCK_DM)
    dm_ok = offs_dm < D_MAIN
    q_base = Q + b * stride_qb + i * stride_qs + heads[:, None] * stride_qh
    q_main = tl.load(q_base + offs_dm[None, :] * stride_qd, mask=h_ok[:, None] & dm_ok[None, :], other=0.0)
    offs_dt = tl.arange(0, BLOCK_DT)
    dt_ok = offs_dt < D_TAIL
    if HAS_TAIL:
        q_tail = tl.load(q_base + (D_MAIN + offs_dt[None, :]) * stride_qd, mask=h_ok[:, None] & dt_ok[None, :],
                         other=0.0)
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
    for start in range(0, TOPK, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        idx = tl.load(i_base + offs_k * stride_ik, mask=offs_k < TOPK, other=-1)
        valid = idx >= 0
        if tl.max(valid.to(tl.int32), 0) > 0:
            rows = tl.where(valid, idx, 0).to(tl.int64)
            k_main = tl.load(k_base + rows[:, None] * stride_kt + offs_dm[None, :] * stride_kd,
                             mask=valid[:, None] & dm_ok[None, :], other=0.0)
            s = tl.dot(q_main, tl.trans(k_main), input_precision=PRECISION)
            if HAS_TAIL:
                k_tail = tl.load(k_base + rows[:, None] * stride_kt + (D_MAIN + offs_dt[None, :]) * stride_kd,
                                 mask=valid[:, None] & dt_ok[None, :], other=0.0)
                s += tl.dot(q_tail, tl.trans(k_tail), input_precision=PRECISION)
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
            m_i = m_new

    alive = l_i > 0
    safe_l = tl.where(alive, l_i, 1.0)
    o = acc / safe_l[:, None]
    o_base = Out + b * stride_ob + i * stride_os + heads[:, None] * stride_oh
    if SHARED_V:
        tl.store(o_base + offs_dm[None, :] * stride_od, o.to(Out.dtype.element_ty),
                 mask=h_ok[:, None] & (offs_dm < D_V)[None, :])
    else:
        tl.store(o_base + (dv0 + offs_dv[None, :]) * stride_od, o.to(Out.dtype.element_ty),
                 mask=h_ok[:, None] & dv_ok[None, :])
    if tl.program_id(2) == 0:
        lse = tl.where(alive, (m_i + tl.log2(safe_l)) * LN2, float("-inf"))
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


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def head_widths(d_qk: int) -> tuple[int, int, int, int]:
    """(main width, its block, tail width, its block): the main part is the largest power of two <= d_qk
    (at least one 16-wide MMA block), the tail the rest (576 -> 512 + 64, 192 -> 128 + 64)."""
    main = 1 << (d_qk.bit_length() - 1)
    if main < 16:
        return d_qk, 16, 0, 16
    tail = d_qk - main
    return main, main, tail, max(16, next_power_of_2(tail))


def default_config(groups: int, d_qk: int, d_v: int, dtype: torch.dtype) -> SparseConfig:
    """Fixed configs (no autotuning: deterministic launches, and the interpreter cannot tune).

    From the H100 sweep of ``python -m kda_compile.bench dsa --modes configs`` (deepseek_v32 widths, 4k
    prefill, top-k 2048, bf16; docs/dsa.md): 128 heads per program with d_v split over two programs
    (186 TFLOP/s: each gathered key chunk serves 128 heads; the split keeps the [128, 256] accumulator in
    registers) beat 64 heads x 64 keys (158) and 64 x 32 (139). Float32 or smaller groups use smaller
    head blocks (shared memory; at least 16, the MMA's minimum)."""
    if interpreted():
        return SparseConfig(16, 16, 1, 1, 1)
    wide = max(d_qk, d_v) > 256
    block_h = min(128, max(16, next_power_of_2(groups)))
    if dtype == torch.float32:
        block_h = min(block_h, 32 if wide else 64)
        return SparseConfig(block_h, 16 if wide else 32, 1, 8 if wide else 4, 2)
    if block_h == 128 and wide:
        return SparseConfig(128, 32, 2, 8, 2)
    if block_h == 128:
        return SparseConfig(64, 64, 1, 8, 2)
    return SparseConfig(block_h, 64 if block_h >= 32 else 32, 1, 8 if wide else 4, 2)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def sparse_attention_fwd_triton(q, k, v, indices, scale: float, d_v: int, *, config: SparseConfig | None = None):
    """(o [B, S, Hq, d_v] contiguous in q's dtype, lse [B, S, Hq] float32) of ``dsa_sparse_attention``.

    q [B, S, Hq, Dqk], k [B, T, Hkv, Dqk], v [B, T, Hkv, d_v] or None (value = k[..., :d_v]), indices
    int32 [B, S, topk]; any strides."""
    b, s_len, hq, d_qk = q.shape
    hkv = k.shape[2]
    groups = hq // hkv
    topk = indices.shape[-1]
    o = torch.empty((b, s_len, hq, d_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, s_len, hq), dtype=torch.float32, device=q.device)
    if b * s_len == 0:
        return o, lse
    cfg = config or default_config(groups, d_qk, d_v, q.dtype)
    d_main, block_dm, d_tail, block_dt = head_widths(d_qk)
    shared_v = v is None and cfg.dv_splits == 1 and d_v == d_main == block_dm
    dv_per_program = cdiv(d_v, cfg.dv_splits)
    block_dv = max(16, next_power_of_2(dv_per_program))
    value = k if v is None else v
    grid = (b * s_len, hkv * cdiv(groups, cfg.block_h), cfg.dv_splits)
    sparse_attention_fwd_kernel[grid](
        q, k, value, indices, o, lse,
        *q.stride(), *k.stride(), *value.stride(), *indices.stride(), *o.stride(), *lse.stride(),
        s_len, topk, groups, d_main, d_tail, d_v, dv_per_program, float(scale),
        BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k, BLOCK_DM=block_dm, BLOCK_DT=block_dt, BLOCK_DV=block_dv,
        HAS_TAIL=d_tail > 0, SHARED_V=shared_v, PRECISION=_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return o, lse
