"""``causal_conv1d_update`` in one Triton launch: the conv, the activation and the rolled state together.

Program (sequence b, block of BLOCK_C channels) owns its channels' state: it loads every value it needs (the W taps
of each new token, the L values of the rolled state) before a barrier and stores after it, so the state is updated
in place without a race (no other program touches these channels). Taps and the rolled state read the old state
where they reach before the new tokens and ``x`` elsewhere (two masked loads). Sums in float32 plus the bias, rounded
to ``weight``'s dtype (what the grouped ``F.conv1d`` returns), SiLU in float32 on that value, rounded to ``weight``'s
dtype and stored in ``x``'s: the reference's roundings. Device-agnostic: runs under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_C = 128  # channels per program


@triton.jit
def _tap(x_ptr, state_ptr, position, c, c_ok, stride_xc, stride_xt, stride_sc, stride_sl, STATE_LEN: tl.constexpr):
    """Element ``position`` of ``cat([state, x], -1)`` for channels ``c`` (a scalar position)."""
    old = tl.load(state_ptr + c * stride_sc + position * stride_sl, mask=c_ok & (position < STATE_LEN), other=0.0)
    new = tl.load(x_ptr + c * stride_xc + (position - STATE_LEN) * stride_xt, mask=c_ok & (position >= STATE_LEN),
                  other=0.0)
    return old.to(tl.float32) + new.to(tl.float32)


@triton.jit
def _update(x_ptr, state_ptr, w_ptr, b_ptr, out_ptr, C, T,
            stride_xb, stride_xc, stride_xt, stride_sb, stride_sc, stride_sl, stride_wc, stride_wj,
            stride_ob, stride_oc, stride_ot,
            STATE_LEN: tl.constexpr, WIDTH: tl.constexpr, BLOCK_L: tl.constexpr, HAS_BIAS: tl.constexpr,
            SILU: tl.constexpr, BLOCK_C: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    x_ptr += seq * stride_xb
    state_ptr += seq * stride_sb
    out_ptr += seq * stride_ob
    w_dtype = w_ptr.dtype.element_ty
    # the rolled state: element T + l of cat([state, x]), read before any store
    lanes = tl.arange(0, BLOCK_L)
    source = T + lanes
    lane_ok = c_ok[:, None] & (lanes[None, :] < STATE_LEN)
    old = tl.load(state_ptr + c[:, None] * stride_sc + source[None, :] * stride_sl,
                  mask=lane_ok & (source[None, :] < STATE_LEN), other=0.0)
    new = tl.load(x_ptr + c[:, None] * stride_xc + (source[None, :] - STATE_LEN) * stride_xt,
                  mask=lane_ok & (source[None, :] >= STATE_LEN), other=0.0)
    rolled = (old.to(tl.float32) + new.to(tl.float32)).to(w_dtype)
    if HAS_BIAS:
        bias = tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for t in range(T):
        acc = bias
        for j in tl.static_range(WIDTH):
            value = _tap(x_ptr, state_ptr, STATE_LEN + t - WIDTH + 1 + j, c, c_ok, stride_xc, stride_xt, stride_sc,
                         stride_sl, STATE_LEN).to(w_dtype).to(tl.float32)
            acc += value * tl.load(w_ptr + c * stride_wc + j * stride_wj, mask=c_ok, other=0.0).to(tl.float32)
        out = acc.to(w_dtype).to(tl.float32)
        if SILU:
            out = (out * tl.sigmoid(out)).to(w_dtype).to(tl.float32)
        tl.store(out_ptr + c * stride_oc + t * stride_ot, out.to(out_ptr.dtype.element_ty), mask=c_ok)
    tl.debug_barrier()  # every load of the old state above happens before the state is overwritten
    tl.store(state_ptr + c[:, None] * stride_sc + lanes[None, :] * stride_sl,
             rolled.to(state_ptr.dtype.element_ty), mask=lane_ok)


def causal_conv1d_update_triton(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                                bias: torch.Tensor | None, activation: str | None) -> torch.Tensor:
    """``causal_conv1d_update`` (reference.py) on one device; the caller makes it current."""
    batch, channels, tokens = x.shape
    state_len, width = conv_state.shape[-1], weight.shape[-1]
    out = torch.empty(batch, channels, tokens, device=x.device, dtype=x.dtype)
    if batch == 0 or channels == 0:
        return out
    _update[(batch, triton.cdiv(channels, BLOCK_C))](
        x, conv_state, weight, weight if bias is None else bias, out, channels, tokens,
        *x.stride(), *conv_state.stride(), *weight.stride(), *out.stride(),
        STATE_LEN=state_len, WIDTH=width, BLOCK_L=triton.next_power_of_2(state_len), HAS_BIAS=bias is not None,
        SILU=activation is not None, BLOCK_C=BLOCK_C, num_warps=4)
    return out
