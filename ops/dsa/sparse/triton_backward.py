"""Triton kernels for DSA's sparse attention backward: dq per query, dk / dv per selected key chunk.

Kernels and launcher only. Both recompute ``p = exp(s - lse)`` from the forward's lse (no max pass) and
``ds = p * (dO . v - delta)`` with ``delta = rowsum(dO * O) - dlse`` computed beforehand.

- ``sparse_attention_dq_kernel``: one program per (query token, head block), as the forward; walks the
  token's selection and accumulates ``dq = scale * ds @ k`` in registers. No atomics.
- ``sparse_attention_dkv_kernel``: one program per (query token, chunk of BLOCK_K selected keys, KV head);
  loads the chunk's key (and value) rows once, loops over ALL query heads of the group in blocks, and
  accumulates ``scale * ds^T @ q`` and ``p^T @ dO`` for the chunk in registers; then ONE float32 atomic add
  per selected row (many queries select the same key, so the rows are shared). Summing over the heads
  before the atomic divides the atomics by the number of head blocks (4 at 128 heads), which bound a
  single fused kernel (about 10x the forward). In the absorbed form with d_v = the main width the value is
  the key's main tile, so both gradients go into one accumulator.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kda_compile.ops._common import cdiv, next_power_of_2
from kda_compile.ops.dsa.sparse.triton_forward import LOG2E, gather_scores, head_widths, interpreted


@triton.jit
def sparse_attention_dq_kernel(
    Q, K, V, Idx, DO, Lse, Delta, DQ,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ib, stride_is, stride_ik,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_ls, stride_lh,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    S, TOPK, GROUPS, D_MAIN, D_TAIL, D_V, scale,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DM: tl.constexpr, BLOCK_DT: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_TAIL: tl.constexpr, SHARED_V: tl.constexpr, PRECISION: tl.constexpr,
):
    """DQ [B, S, Hq, Dqk] of one token and head block. Lse, Delta [B, S, Hq] float32 (same strides),
    DO [B, S, Hq, Dv]. Grid (B * S, Hkv * head blocks per group)."""
    token = tl.program_id(0)
    b = (token // S).to(tl.int64)
    i = (token % S).to(tl.int64)
    blocks_per_group = tl.cdiv(GROUPS, BLOCK_H)
    kvh = tl.program_id(1) // blocks_per_group
    in_group = (tl.program_id(1) % blocks_per_group) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = in_group < GROUPS
    heads = kvh * GROUPS + in_group

    offs_dm = tl.arange(0, BLOCK_DM)
    dm_ok = offs_dm < D_MAIN
    offs_dt = tl.arange(0, BLOCK_DT)
    dt_ok = offs_dt < D_TAIL
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < D_V
    q_base = Q + b * stride_qb + i * stride_qs + heads[:, None] * stride_qh
    q_main = tl.load(q_base + offs_dm[None, :] * stride_qd, mask=h_ok[:, None] & dm_ok[None, :], other=0.0)
    if HAS_TAIL:
        q_tail = tl.load(q_base + (D_MAIN + offs_dt[None, :]) * stride_qd, mask=h_ok[:, None] & dt_ok[None, :],
                         other=0.0)
    else:
        q_tail = q_main  # unused
    stat = b * stride_lb + i * stride_ls + heads * stride_lh
    lse = tl.load(Lse + stat, mask=h_ok, other=float("-inf"))
    alive = lse > float("-inf")
    lse2 = tl.where(alive, lse * LOG2E, 0.0)
    delta = tl.load(Delta + stat, mask=h_ok, other=0.0)
    do_base = DO + b * stride_ob + i * stride_os + heads[:, None] * stride_oh
    if SHARED_V:
        do = tl.load(do_base + offs_dm[None, :] * stride_od, mask=h_ok[:, None] & (offs_dm < D_V)[None, :],
                     other=0.0)
    else:
        do = tl.load(do_base + offs_dv[None, :] * stride_od, mask=h_ok[:, None] & dv_ok[None, :], other=0.0)

    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    i_base = Idx + b * stride_ib + i * stride_is
    qk_scale = scale * LOG2E
    dq_main = tl.zeros([BLOCK_H, BLOCK_DM], dtype=tl.float32)
    dq_tail = tl.zeros([BLOCK_H, BLOCK_DT], dtype=tl.float32)
    for start in range(0, TOPK, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        idx = tl.load(i_base + offs_k * stride_ik, mask=offs_k < TOPK, other=-1)
        valid = idx >= 0
        if tl.max(valid.to(tl.int32), 0) > 0:
            rows, k_main, k_tail, s = gather_scores(q_main, q_tail, k_base, idx, valid, offs_dm, dm_ok, offs_dt,
                                                    dt_ok, stride_kt, stride_kd, D_MAIN, HAS_TAIL, PRECISION)
            keep = valid[None, :] & alive[:, None]
            p = tl.where(keep, tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
            if SHARED_V:
                dp = tl.dot(do, tl.trans(k_main), input_precision=PRECISION)
            else:
                v = tl.load(v_base + rows[:, None] * stride_vt + offs_dv[None, :] * stride_vd,
                            mask=valid[:, None] & dv_ok[None, :], other=0.0)
                dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            ds_in = ds.to(k_main.dtype)
            dq_main += tl.dot(ds_in, k_main, input_precision=PRECISION)
            if HAS_TAIL:
                dq_tail += tl.dot(ds_in, k_tail, input_precision=PRECISION)

    dq_base = DQ + b * stride_dqb + i * stride_dqs + heads[:, None] * stride_dqh
    tl.store(dq_base + offs_dm[None, :] * stride_dqd, (dq_main * scale).to(DQ.dtype.element_ty),
             mask=h_ok[:, None] & dm_ok[None, :])
    if HAS_TAIL:
        tl.store(dq_base + (D_MAIN + offs_dt[None, :]) * stride_dqd, (dq_tail * scale).to(DQ.dtype.element_ty),
                 mask=h_ok[:, None] & dt_ok[None, :])


@triton.jit
def sparse_attention_dkv_kernel(
    Q, K, V, Idx, DO, Lse, Delta, DK, DV,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ib, stride_is, stride_ik,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_ls, stride_lh,
    stride_dkb, stride_dkt, stride_dkh, stride_dkd,
    stride_dvb, stride_dvt, stride_dvh, stride_dvd,
    S, TOPK, GROUPS, D_MAIN, D_TAIL, D_V, scale,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DM: tl.constexpr, BLOCK_DT: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_TAIL: tl.constexpr, SHARED_V: tl.constexpr, PRECISION: tl.constexpr,
):
    """DK [B, T, Hkv, Dqk] / DV [B, T, Hkv, Dv] (float32, accumulated) from one token's chunk of selected
    keys, summed over every query head of KV head ``program_id(2)``. Grid (B * S, topk chunks, Hkv)."""
    token = tl.program_id(0)
    b = (token // S).to(tl.int64)
    i = (token % S).to(tl.int64)
    kvh = tl.program_id(2)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    idx = tl.load(Idx + b * stride_ib + i * stride_is + offs_k * stride_ik, mask=offs_k < TOPK, other=-1)
    valid = idx >= 0
    if tl.max(valid.to(tl.int32), 0) > 0:
        rows = tl.where(valid, idx, 0).to(tl.int64)
        offs_dm = tl.arange(0, BLOCK_DM)
        dm_ok = offs_dm < D_MAIN
        offs_dt = tl.arange(0, BLOCK_DT)
        dt_ok = offs_dt < D_TAIL
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_ok = offs_dv < D_V
        k_rows = K + b * stride_kb + kvh * stride_kh + rows[:, None] * stride_kt
        k_main = tl.load(k_rows + offs_dm[None, :] * stride_kd, mask=valid[:, None] & dm_ok[None, :], other=0.0)
        if HAS_TAIL:
            k_tail = tl.load(k_rows + (D_MAIN + offs_dt[None, :]) * stride_kd, mask=valid[:, None] & dt_ok[None, :],
                             other=0.0)
        if not SHARED_V:
            v = tl.load(V + b * stride_vb + kvh * stride_vh + rows[:, None] * stride_vt + offs_dv[None, :] * stride_vd,
                        mask=valid[:, None] & dv_ok[None, :], other=0.0)
            dv_acc = tl.zeros([BLOCK_K, BLOCK_DV], dtype=tl.float32)
        dk_main = tl.zeros([BLOCK_K, BLOCK_DM], dtype=tl.float32)
        dk_tail = tl.zeros([BLOCK_K, BLOCK_DT], dtype=tl.float32)
        qk_scale = scale * LOG2E
        for h0 in range(0, GROUPS, BLOCK_H):
            in_group = h0 + tl.arange(0, BLOCK_H)
            h_ok = in_group < GROUPS
            heads = kvh * GROUPS + in_group
            q_base = Q + b * stride_qb + i * stride_qs + heads[:, None] * stride_qh
            q_main = tl.load(q_base + offs_dm[None, :] * stride_qd, mask=h_ok[:, None] & dm_ok[None, :], other=0.0)
            stat = b * stride_lb + i * stride_ls + heads * stride_lh
            lse = tl.load(Lse + stat, mask=h_ok, other=float("-inf"))
            alive = lse > float("-inf")
            delta = tl.load(Delta + stat, mask=h_ok, other=0.0)
            s = tl.dot(q_main, tl.trans(k_main), input_precision=PRECISION)
            if HAS_TAIL:
                q_tail = tl.load(q_base + (D_MAIN + offs_dt[None, :]) * stride_qd,
                                 mask=h_ok[:, None] & dt_ok[None, :], other=0.0)
                s += tl.dot(q_tail, tl.trans(k_tail), input_precision=PRECISION)
            keep = valid[None, :] & alive[:, None]
            p = tl.where(keep, tl.exp2(s * qk_scale - tl.where(alive, lse * LOG2E, 0.0)[:, None]), 0.0)
            do_base = DO + b * stride_ob + i * stride_os + heads[:, None] * stride_oh
            if SHARED_V:
                do = tl.load(do_base + offs_dm[None, :] * stride_od,
                             mask=h_ok[:, None] & (offs_dm < D_V)[None, :], other=0.0)
                dp = tl.dot(do, tl.trans(k_main), input_precision=PRECISION)
            else:
                do = tl.load(do_base + offs_dv[None, :] * stride_od, mask=h_ok[:, None] & dv_ok[None, :], other=0.0)
                dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            # scale folded into ds before the cast: dk = scale * ds^T q
            ds = (p * (dp - delta[:, None]) * scale).to(k_main.dtype)
            dk_main += tl.dot(tl.trans(ds), q_main, input_precision=PRECISION)
            if HAS_TAIL:
                dk_tail += tl.dot(tl.trans(ds), q_tail, input_precision=PRECISION)
            if SHARED_V:
                dk_main += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            else:
                dv_acc += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        dk_rows = DK + b * stride_dkb + kvh * stride_dkh + rows[:, None] * stride_dkt
        tl.atomic_add(dk_rows + offs_dm[None, :] * stride_dkd, dk_main, mask=valid[:, None] & dm_ok[None, :])
        if HAS_TAIL:
            tl.atomic_add(dk_rows + (D_MAIN + offs_dt[None, :]) * stride_dkd, dk_tail,
                          mask=valid[:, None] & dt_ok[None, :])
        if not SHARED_V:
            tl.atomic_add(DV + b * stride_dvb + kvh * stride_dvh + rows[:, None] * stride_dvt
                          + offs_dv[None, :] * stride_dvd, dv_acc, mask=valid[:, None] & dv_ok[None, :])


def _config(groups: int, d_qk: int, dtype: torch.dtype):
    """(BLOCK_H, BLOCK_K, num_warps, num_stages) of both kernels: the dq kernel holds q, dO and dq of a head
    block, the dkv kernel a key chunk, its two accumulators and one head block of q and dO, so blocks are
    half the forward's (32 heads x 32 keys for 576-wide half-precision heads)."""
    if interpreted():
        return 16, 16, 1, 1
    block_h = min(32, max(16, next_power_of_2(groups)))
    wide = d_qk > 256
    block_k = 16 if (wide and dtype == torch.float32) else 32
    return block_h, block_k, 8 if wide else 4, 1


def sparse_attention_bwd_triton(grad_o, grad_lse, q, k, v, indices, o, lse, scale: float, d_v: int, *,
                                config: tuple[int, int, int, int] | None = None):
    """(dq in q's dtype, dk float32, dv float32 or None) of ``dsa_sparse_attention``; with v None the
    value's gradient is inside dk[..., :d_v]. ``config``: (BLOCK_H, BLOCK_K, num_warps, num_stages) to
    override the default (tuning)."""
    b, s_len, hq, d_qk = q.shape
    hkv = k.shape[2]
    groups = hq // hkv
    topk = indices.shape[-1]
    dq = torch.empty((b, s_len, hq, d_qk), dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device) if v is not None else None
    if b * s_len == 0:
        return dq, dk, dv
    grad_o = grad_o.to(q.dtype)
    delta = (grad_o.float() * o.float()).sum(-1)
    if grad_lse is not None:
        delta = delta - torch.where(torch.isfinite(lse), grad_lse.float(), torch.zeros_like(delta))
    delta = delta.contiguous()
    lse = lse.contiguous()
    block_h, block_k, warps, stages = config or _config(groups, d_qk, q.dtype)
    d_main, block_dm, d_tail, block_dt = head_widths(d_qk)
    shared_v = v is None and d_v == d_main == block_dm
    block_dv = max(16, next_power_of_2(d_v))
    value, dvalue = (k, dk) if v is None else (v, dv)
    if v is None and not shared_v:
        value = k[..., :d_v]
        dvalue = dk[..., :d_v]  # a view: the value's gradient lands in dk's first d_v columns
    common = (*q.stride(), *k.stride(), *value.stride(), *indices.stride(), *grad_o.stride(), *lse.stride())
    meta = dict(BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_DM=block_dm, BLOCK_DT=block_dt, BLOCK_DV=block_dv,
                HAS_TAIL=d_tail > 0, SHARED_V=shared_v, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                num_warps=warps, num_stages=stages)
    sizes = (s_len, topk, groups, d_main, d_tail, d_v, float(scale))
    sparse_attention_dq_kernel[(b * s_len, hkv * cdiv(groups, block_h))](
        q, k, value, indices, grad_o, lse, delta, dq, *common, *dq.stride(), *sizes, **meta)
    sparse_attention_dkv_kernel[(b * s_len, cdiv(topk, block_k), hkv)](
        q, k, value, indices, grad_o, lse, delta, dk, dvalue, *common, *dk.stride(), *dvalue.stride(), *sizes,
        **meta)
    return dq, dk, dv
