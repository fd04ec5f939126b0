"""Launchers for the Triton attention kernels (``triton_flash_kernels.py``): layouts, tile configs, row vectors.

Device-agnostic (no ``torch.cuda`` calls), so the same launchers run on CPU tensors under
``TRITON_INTERPRET=1``, where one small fixed tile config is used (the interpreter cannot autotune).

Layouts: inputs are taken with any strides. Outputs follow the op's fixed layout: ``out``/``dq`` are
[B, H, Sq, D] views of [B, Sq, H, D] storage (``dk``/``dv`` likewise), so the usual
``out.transpose(1, 2).reshape(B, Sq, H * D)`` after attention is free.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kda_compile.ops._common import cdiv, next_power_of_2, triton_interpreted as _interpreted
from kda_compile.ops.attention.triton_flash_kernels import (
    attn_bwd_delta_kernel,
    attn_bwd_dkdv_kernel,
    attn_bwd_dq_kernel,
    attn_fwd_kernel,
)


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Head-dim blocks are at least 32 wide: 16-wide value blocks under a masked 32-wide key block returned wrong
# rows on sm_90 with Triton 3.6, the same narrow-block family as the KDA scan's (docs/attention.md section 2).
MIN_HEAD_BLOCK = 32


def _head_block(d: int) -> int:
    return max(MIN_HEAD_BLOCK, next_power_of_2(d))


# Fixed configs per padded head dim (no autotuning: deterministic, and the interpreter cannot tune).
# Forward / dQ tiles favour many query rows; dK/dV holds two [BLOCK_N, D] fp32 accumulators.
_FWD = {64: TileConfig(128, 64, 4, 3), 128: TileConfig(128, 64, 8, 3), 256: TileConfig(64, 32, 4, 2)}
_DQ = {64: TileConfig(64, 64, 4, 3), 128: TileConfig(64, 64, 4, 3), 256: TileConfig(32, 32, 4, 2)}
_DKDV = {64: TileConfig(32, 64, 4, 3), 128: TileConfig(32, 64, 4, 3), 256: TileConfig(32, 32, 4, 2)}
_INTERPRET = TileConfig(16, 16, 1, 1)


def _config(table, d_block: int) -> TileConfig:
    if _interpreted():
        return _INTERPRET
    for limit in sorted(table):
        if d_block <= limit:
            return table[limit]
    return table[max(table)]


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs keep full fp32 products (the op's semantics); half types use tensor cores.
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def bshd_empty(b: int, h: int, s: int, d: int, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """A [B, H, S, D] tensor stored as [B, S, H, D] (the op's output layout)."""
    return torch.empty((b, s, h, d), dtype=dtype or like.dtype, device=like.device).transpose(1, 2)


def mask_for_kernel(attn_mask: torch.Tensor | None, b: int, h: int, sq: int, sk: int):
    """(tensor, kind, strides) of a mask broadcast to [B, H, Sq, Sk] without copying.

    kind: 0 none, 1 bool (reinterpreted as uint8), 2 additive float.
    """
    if attn_mask is None:
        return None, 0, (0, 0, 0, 0)
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    m = m.expand(b, h, sq, sk)
    kind = 1 if m.dtype == torch.bool else 2
    if kind == 1:
        m = m.view(torch.uint8)
    return m, kind, tuple(m.stride())


def _flags(is_causal: bool, sliding_window: int, mask_kind: int, softcap: float, dropout_p: float):
    return dict(
        IS_CAUSAL=bool(is_causal),
        HAS_WINDOW=bool(is_causal and sliding_window > 0),
        MASK_KIND=mask_kind,
        HAS_SOFTCAP=softcap > 0.0,
        HAS_DROPOUT=dropout_p > 0.0,
    )


def triton_attention_forward(q, k, v, attn_mask, sinks, scale: float, softcap: float, dropout_p: float,
                             is_causal: bool, sliding_window: int, rng: torch.Tensor):
    """out [B, H, Sq, Dv] (BSHD storage, q's dtype) and lse [B, H, Sq] float32 (scores only).

    ``rng``: the op's int64 seed tensor on q's device (element 0 is the dropout seed; unread, and may
    be empty, without dropout)."""
    b, h, sq, dqk = q.shape
    hkv, sk, dv = v.shape[1], v.shape[2], v.shape[3]
    out = bshd_empty(b, h, sq, dv, q)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    mask, kind, ms = mask_for_kernel(attn_mask, b, h, sq, sk)
    bdq, bdv = _head_block(dqk), _head_block(dv)
    cfg = _config(_FWD, max(bdq, bdv))
    grid = (cdiv(sq, cfg.block_m), b * h)
    attn_fwd_kernel[grid](
        q, k, v, out, lse, mask if mask is not None else q, sinks if sinks is not None else q,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *ms,
        h, sq, sk, h // hkv, dqk, dv, float(scale), float(softcap), int(sliding_window), float(dropout_p),
        rng if dropout_p > 0.0 else q,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_DQK=bdq, BLOCK_DV=bdv,
        HAS_SINKS=sinks is not None, PRECISION=_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_flags(is_causal, sliding_window, kind, softcap, dropout_p),
    )
    return out, lse


def backward_row_vectors(delta, lse, sinks, grad_lse):
    """Per-row terms of the backward from Delta = rowsum(dO * O) and the scores-only lse.

    Returns (lse_for_kernel, row_scale, row_bias, dsinks):
    - lse_for_kernel: lse with -inf (rows attending nothing) replaced by +inf so exp(s - lse) = 0;
    - row_scale a = sigmoid(lse - sink), the share of the denominator held by the scores (1 without sinks);
    - row_bias = g_lse - a * Delta;
    - dsinks[h] = -sum over (batch, rows) of (1 - a) * Delta (None without sinks).
    """
    lse_k = torch.where(lse == float("-inf"), torch.full_like(lse, float("inf")), lse)
    dsinks = None
    if sinks is not None:
        sink_logit = sinks.float().view(1, -1, 1)
        a = torch.sigmoid(lse - sink_logit)
        dsinks = -(torch.sigmoid(sink_logit - lse) * delta).sum(dim=(0, 2))  # 1 - a without cancellation
    else:
        a = torch.ones_like(lse)
    bias = -a * delta
    if grad_lse is not None:
        bias = bias + grad_lse.float()
    return lse_k.contiguous(), a.contiguous(), bias.contiguous(), dsinks


def triton_row_delta(out, grad_out):
    """Delta [B, H, Sq] float32 = sum over Dv of grad_out * out (both [B, H, Sq, Dv], any strides)."""
    b, h, sq, dv = out.shape
    delta = torch.empty((b, h, sq), dtype=torch.float32, device=out.device)
    block_m = 16 if _interpreted() else 64
    attn_bwd_delta_kernel[(cdiv(sq, block_m), b * h)](
        out, grad_out, delta, *out.stride(), *grad_out.stride(), h, sq, dv,
        BLOCK_M=block_m, BLOCK_DV=_head_block(dv),
    )
    return delta


def triton_attention_backward(grad_out, grad_lse, q, k, v, out, lse, attn_mask, sinks, scale: float,
                              softcap: float, dropout_p: float, is_causal: bool, sliding_window: int,
                              rng: torch.Tensor, mask_needs_grad: bool):
    """Gradients (dq, dk, dv, dmask_full, dsinks) from the forward's out and scores-only lse.

    dq/dk/dv are BSHD-stored [B, H, S, D] in the inputs' dtypes; dmask_full is the float32 gradient of
    an additive mask at full [B, H, Sq, Sk] (None unless requested; the caller reduces it to the
    mask's shape); dsinks is float32 [H] or None. Works from any backend's forward: only out and lse
    are used (plus the dropout seed ``rng``, which only this kernel's forward uses).
    """
    b, h, sq, dqk = q.shape
    hkv, sk, dv = v.shape[1], v.shape[2], v.shape[3]
    delta = triton_row_delta(out, grad_out)
    lse_k, row_scale, row_bias, dsinks = backward_row_vectors(delta, lse, sinks, grad_lse)
    mask, kind, ms = mask_for_kernel(attn_mask, b, h, sq, sk)
    dq = bshd_empty(b, h, sq, dqk, q)
    dk = bshd_empty(b, hkv, sk, dqk, k)
    dvv = bshd_empty(b, hkv, sk, dv, v)
    dmask = torch.zeros((b, h, sq, sk), dtype=torch.float32, device=q.device) if mask_needs_grad else None
    bdq, bdv = _head_block(dqk), _head_block(dv)
    flags = _flags(is_causal, sliding_window, kind, softcap, dropout_p)
    common = (h // hkv, dqk, dv, float(scale), float(softcap), int(sliding_window), float(dropout_p),
              rng if dropout_p > 0.0 else q)
    mask_arg = mask if mask is not None else q
    cfg = _config(_DQ, max(bdq, bdv))
    attn_bwd_dq_kernel[(cdiv(sq, cfg.block_m), b * h)](
        q, k, v, grad_out, dq, lse_k, row_scale, row_bias, mask_arg, dmask if dmask is not None else q,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dq.stride(), *ms,
        h, sq, sk, *common,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_DQK=bdq, BLOCK_DV=bdv,
        STORE_DMASK=dmask is not None, PRECISION=_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags,
    )
    cfg = _config(_DKDV, max(bdq, bdv))
    attn_bwd_dkdv_kernel[(cdiv(sk, cfg.block_n), b * hkv)](
        q, k, v, grad_out, dk, dvv, lse_k, row_scale, row_bias, mask_arg,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dk.stride(), *dvv.stride(), *ms,
        h, hkv, sq, sk, *common,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_DQK=bdq, BLOCK_DV=bdv,
        PRECISION=_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags,
    )
    return dq, dk, dvv, dmask, dsinks
