"""Triton backward kernel of the block-sparse attention: dq per program, dk / dv by float32 atomics.

Kernel and launcher only (no torch.compile, no dispatch). The programs are the forward's (one per batch row,
query, KV group and block of the group's heads; ``triton_forward.py``), walking the same selection in block
order with repeats skipped, tile by tile. Each recomputes the probabilities from the forward's log-sum-exp,
``p = exp(s - lse)``, and with ``delta = rowsum(dout * out)`` (a torch reduction before the launch) forms
``ds = p * (dout @ v^T - delta)``: then ``dq += scale * ds @ k`` in registers (the program owns its rows,
so dq is stored once, in the query dtype), while ``dk += scale * ds^T @ q`` and ``dv += p^T @ dout`` go to float32
buffers [B, G, T, *] by atomic adds (the queries that selected a block add to it concurrently; the order of
those adds is not fixed, so dk / dv are not bitwise reproducible run to run). A row without a visible key
(lse = -inf) contributes nothing. docs/block-sparse.md, section "Backward".
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kda_compile.ops.block_sparse.triton_forward import LOG2E, program_rows, selected_tile, selection_walk


@triton.jit
def _tile_gradients(q, do, lse2, delta, k_base, v_base, pad_base, dk_base, dv_base, start, pos, T, offs_n,
                    offs_d, d_ok, offs_dv, dv_ok, dq, qk_scale, scale, stride_kt, stride_kd, stride_vt, stride_vd,
                    stride_mt, stride_gt, stride_gd, stride_ht, stride_hd,
                    HAS_PAD: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile [start, start + BLOCK_N): dq accumulated and returned, dk / dv added atomically."""
    slots = start + offs_n
    in_keys = slots < T
    ok = in_keys & (slots <= pos)
    if HAS_PAD:
        ok &= tl.load(pad_base + slots * stride_mt, mask=in_keys, other=0) != 0
    rows = slots.to(tl.int64)
    k = tl.load(k_base + rows[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                mask=in_keys[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(v_base + rows[:, None] * stride_vt + offs_dv[None, :] * stride_vd,
                mask=in_keys[:, None] & dv_ok[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    p = tl.where(ok[None, :], tl.exp2(s - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    dv_tile = tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
    dk_tile = tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION) * scale
    tl.atomic_add(dk_base + rows[:, None] * stride_gt + offs_d[None, :] * stride_gd, dk_tile,
                  mask=in_keys[:, None] & d_ok[None, :])
    tl.atomic_add(dv_base + rows[:, None] * stride_ht + offs_dv[None, :] * stride_hd, dv_tile,
                  mask=in_keys[:, None] & dv_ok[None, :])
    return dq


@triton.jit
def block_sparse_attention_bwd_kernel(
    Q, K, V, Idx, Pos, Pad, DO, Lse, Delta, DQ, DK, DV,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kg, stride_kt, stride_kd,
    stride_vb, stride_vg, stride_vt, stride_vd,
    stride_ib, stride_ig, stride_is, stride_ik,
    stride_pb, stride_ps, stride_mb, stride_mt,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_ls,
    stride_eb, stride_eh, stride_es,
    stride_gb, stride_gg, stride_gt, stride_gd,
    stride_hb, stride_hg, stride_ht, stride_hd,
    SQ, T, SLOTS, HEADS_PER_GROUP, HEAD_BLOCKS, D, DV_WIDTH, NUM_BLOCKS, scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_POS: tl.constexpr, HAS_PAD: tl.constexpr, PRECISION: tl.constexpr,
):
    """dQ[b, heads, i] (query dtype, [B, H, Sq, D] contiguous) for one query and one block of one group's heads;
    adds into DK [B, G, T, D] and DV [B, G, T, DV] (float32). DO by strides; Lse, Delta float32 [B, H, Sq]; the
    rest as the forward kernel. Grid (B * Sq, G * HEAD_BLOCKS)."""
    b, i, g, heads, h_ok, pos = program_rows(Pos, stride_pb, stride_ps, SQ, T, HEADS_PER_GROUP, HEAD_BLOCKS, BLOCK_M,
                                             HAS_POS)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV_WIDTH
    offs_n = tl.arange(0, BLOCK_N)
    row = b * stride_qb + heads[:, None] * stride_qh + i * stride_qs
    q = tl.load(Q + row + offs_d[None, :] * stride_qd, mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(DO + b * stride_ob + heads[:, None] * stride_oh + i * stride_os + offs_dv[None, :] * stride_od,
                 mask=h_ok[:, None] & dv_ok[None, :], other=0.0)
    stats = b * stride_lb + heads * stride_lh + i * stride_ls
    lse = tl.load(Lse + stats, mask=h_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E  # no key: p = 0 on every slot
    delta = tl.load(Delta + b * stride_eb + heads * stride_eh + i * stride_es, mask=h_ok, other=0.0)
    k_base = K + b * stride_kb + g * stride_kg
    v_base = V + b * stride_vb + g * stride_vg
    dk_base = DK + b * stride_gb + g * stride_gg
    dv_base = DV + b * stride_hb + g * stride_hg
    pad_base = Pad + b * stride_mb
    i_base = Idx + b * stride_ib + g * stride_ig + i * stride_is
    qk_scale = scale * LOG2E
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for tile in range(0, SLOTS * (BLOCK_SIZE // BLOCK_N)):
        start, active = selected_tile(i_base, stride_ik, tile, pos, T, NUM_BLOCKS, BLOCK_SIZE, BLOCK_N)
        if active:
            dq = _tile_gradients(q, do, lse2, delta, k_base, v_base, pad_base, dk_base, dv_base, start, pos, T,
                                 offs_n, offs_d, d_ok, offs_dv, dv_ok, dq, qk_scale, scale, stride_kt, stride_kd,
                                 stride_vt, stride_vd, stride_mt, stride_gt, stride_gd, stride_ht, stride_hd,
                                 HAS_PAD, PRECISION)
    tl.store(DQ + row + offs_d[None, :] * stride_qd, (dq * scale).to(DQ.dtype.element_ty),
             mask=h_ok[:, None] & d_ok[None, :])


def block_sparse_attention_bwd_triton(grad_out, query, key, value, block_indices, query_positions,
                                      key_padding_mask, out, lse, block_size: int, scale: float):
    """(dq, dk, dv), each contiguous in its input's dtype and shape. ``out`` / ``lse``: the forward's outputs
    (``block_sparse_attention_fwd_triton``)."""
    batch, groups, keys, dim = key.shape
    query = query.contiguous()  # dq is written at query's strides
    launch = query.numel() > 0 and keys > 0
    dq = torch.empty_like(query) if launch else torch.zeros_like(query)  # the kernel writes every row of dq
    dk = torch.zeros((batch, groups, keys, dim), dtype=torch.float32, device=key.device)
    dv = torch.zeros((batch, groups, keys, value.shape[-1]), dtype=torch.float32, device=key.device)
    if launch:
        delta = (grad_out.float() * out.float()).sum(-1)
        walk = selection_walk(query, key, value, block_indices, block_size, query_positions, key_padding_mask)
        block_sparse_attention_bwd_kernel[walk.grid](
            *walk.tensors, grad_out, lse, delta, dq, dk, dv, *walk.strides, *grad_out.stride(), *lse.stride(),
            *delta.stride(), *dk.stride(), *dv.stride(), *walk.sizes, float(scale), **walk.meta,
            num_warps=4, num_stages=1,
        )
    return dq, dk.to(key.dtype), dv.to(value.dtype)
