"""CUDA implementations of ``kda_compile::attention_fwd`` / ``attention_bwd``: pick a kernel per call.

Order of preference (forward and backward are chosen independently; both only exchange the
backend-independent ``out`` and ``lse``, so any backward can follow any forward):

1. torch SDPA backend kernels (``sdpa.py``: cuDNN > flash > memory-efficient, first that accepts);
2. our Triton flash-attention kernel (``triton_flash_kernels.py``) for what SDPA cannot do: softcap,
   dropout (its Philox mask is regenerated in our backward), GQA/windows/masks SDPA refuses, a float
   ``attn_mask`` gradient and a gradient through ``lse``;
3. the plain-torch reference (materialises [B, H, Sq, Sk]) only for float64, without Triton, or when
   forced.
Every path but (1) is reported through ``record_fallback`` with its reason.

``attention_backend(name)`` forces one implementation (tests, benchmarks); a forced SDPA backend that
cannot serve a call raises instead of falling back. With dropout, keep the same choice for the
forward and the backward (the reference and Triton draw different masks from the same seed).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import torch

from kda_compile.ops._common import arg_error, module_unusable, record_fallback
from kda_compile.ops.attention import sdpa
from kda_compile.ops.attention.reference import reference_backward, reference_forward

IMPLEMENTATIONS = ("auto", "cudnn", "flash", "efficient", "triton", "reference")
_forced = contextvars.ContextVar("kda_compile_attention_backend", default="auto")
_FAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@contextlib.contextmanager
def attention_backend(name: str) -> Iterator[None]:
    """Force the implementation of the attention ops inside the block ("auto" restores the default)."""
    if name not in IMPLEMENTATIONS:
        raise arg_error("name", repr(name), f"one of {IMPLEMENTATIONS}")
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


def forced_backend() -> str:
    return _forced.get()


@functools.lru_cache(maxsize=None)
def triton_unavailable() -> str | None:
    """None when the Triton kernels import, else why not."""
    return module_unusable("kda_compile.ops.attention.triton_flash")


# ----------------------------------------------------------------------------------------------
# Layout: out, dq, dk, dv are [B, H, S, D] views of [B, S, H, D] storage (see custom_ops.py).
# ----------------------------------------------------------------------------------------------
def bshd_strides(shape) -> tuple[int, int, int, int]:
    b, h, s, d = shape
    return (s * h * d, d, h * d, 1)


def as_bshd(t: torch.Tensor) -> torch.Tensor:
    """``t`` with exactly the op's output strides, copying only when its memory order differs."""
    expected = bshd_strides(t.shape)
    if tuple(t.stride()) == expected:
        return t
    if t.transpose(1, 2).is_contiguous():  # same memory order; only size-1 dims' strides differ
        return t.as_strided(t.shape, expected)
    b, h, s, d = t.shape
    out = torch.empty((b, s, h, d), dtype=t.dtype, device=t.device).transpose(1, 2)
    return out.copy_(t)


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


# ----------------------------------------------------------------------------------------------
# Planning.
# ----------------------------------------------------------------------------------------------
def _plan(q, k, v, attn_mask, softcap, dropout_p, is_causal, sliding_window, *, backward: bool,
          grad_reason: str | None = None):
    """(implementation, reason for not taking SDPA or None, trimmed problem or None)."""
    forced = forced_backend()
    if forced == "reference":
        return "reference", None, None
    if q.dtype not in _FAST_DTYPES:
        return "reference", f"{q.dtype} inputs have no fast kernel", None
    if forced == "triton":
        if triton_unavailable():
            raise RuntimeError(f"attention backend 'triton' was forced but {triton_unavailable()}")
        return "triton", None, None
    trimmed = None
    if softcap > 0.0:
        why = "softcap is not supported by torch SDPA"
    elif dropout_p > 0.0:
        why = "dropout runs in the Triton kernel (its mask is regenerated exactly in the backward)"
    elif grad_reason is not None:
        why = grad_reason
    else:
        trimmed = sdpa.trim_keys_for_window(k, v, attn_mask, q.shape[2], is_causal, sliding_window)
        k2, v2, m2, causal2, window2, _ = trimmed
        q2, k2, v2 = (_last_dim_contiguous(t) for t in (q, k2, v2))
        if forced in sdpa.SDPA_BACKENDS:
            reason = sdpa.why_not(forced, q2, k2, v2, m2, causal2, window2, backward)
            if reason is not None:
                raise ValueError(f"attention backend {forced!r} was forced but cannot serve this call: {reason}")
            return forced, None, trimmed
        backend, reasons = sdpa.choose(q2, k2, v2, m2, causal2, window2, backward)
        if backend is not None:
            return backend, None, trimmed
        why = "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
    if forced in sdpa.SDPA_BACKENDS:
        raise ValueError(f"attention backend {forced!r} was forced but cannot serve this call: {why}")
    if triton_unavailable():
        return "reference", f"{why}; and {triton_unavailable()}", None
    return "triton", why, None


def _grad_reason(mask_needs_grad: bool, lse_grad: bool) -> str | None:
    if mask_needs_grad:
        return "the float attn_mask needs a gradient (computed by the Triton kernel)"
    if lse_grad:
        return "lse needs a gradient (computed by the Triton kernel)"
    return None


def explain_dispatch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    sliding_window: int | None = None,
    backward: bool = False,
    mask_needs_grad: bool = False,
    lse_grad: bool = False,
) -> tuple[str, str | None]:
    """(implementation, reason) that would serve this call on its device, without running it.

    ``implementation`` is one of "cudnn", "flash", "efficient", "triton", "reference"; ``reason``
    says why SDPA was not taken (None when it was, or when forced). CPU always runs the reference.
    """
    if query.device.type != "cuda":
        return "reference", "the reference is what runs off CUDA"
    grad_reason = _grad_reason(mask_needs_grad, lse_grad) if backward else None
    impl, why, _ = _plan(query, key, value, attn_mask, softcap or 0.0, dropout_p, is_causal, sliding_window or 0,
                         backward=backward, grad_reason=grad_reason)
    return impl, why


# ----------------------------------------------------------------------------------------------
# Forward.
# ----------------------------------------------------------------------------------------------
def _mask_rows_alive(attn_mask, shape):
    """[B, H, Sq] bool: rows whose (broadcastable) mask lets at least one key through."""
    keep = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
    return keep.any(dim=-1).expand(shape)


def cuda_forward(q, k, v, attn_mask, sinks, scale, softcap, dropout_p, is_causal, sliding_window, rng):
    """out [B, H, Sq, Dv] (BSHD storage), lse [B, H, Sq] float32 (scores only, -inf for empty rows)."""
    impl, why, trimmed = _plan(q, k, v, attn_mask, softcap, dropout_p, is_causal, sliding_window,
                               backward=False)
    if impl == "reference":
        if why:
            record_fallback("attention", "reference", why)
        out, lse = reference_forward(q, k, v, attn_mask, sinks, scale, softcap, dropout_p, is_causal,
                                     sliding_window, rng)
        return as_bshd(out), lse
    if impl == "triton":
        from kda_compile.ops.attention.triton_flash import triton_attention_forward

        if why:
            record_fallback("attention", "triton", why)
        return triton_attention_forward(q, k, v, attn_mask, sinks, scale, softcap, dropout_p, is_causal,
                                        sliding_window, rng)
    k2, v2, m2, causal2, window2, _ = trimmed
    q2, k2, v2 = (_last_dim_contiguous(t) for t in (q, k2, v2))
    out, lse = sdpa.sdpa_forward(impl, q2, k2, v2, m2, scale, causal2, window2)
    out, lse = as_bshd(out), lse.float()
    if m2 is not None or (causal2 and q.shape[2] > k2.shape[2]):
        # Rows with nothing to attend: 0 output, lse -inf (the kernels differ: NaN, +inf, a fill value).
        alive = (lse > sdpa.empty_row_threshold(impl, m2)) & (lse < float("inf"))
        if m2 is not None:  # the memory-efficient kernel returns a finite lse for rows its mask empties
            alive &= _mask_rows_alive(m2, lse.shape)
        out = out.masked_fill_(~alive[..., None], 0.0)
        lse = torch.where(alive, lse, torch.full_like(lse, float("-inf")))
    if sinks is not None:
        out = out.mul_(torch.sigmoid(lse - sinks.float().view(1, -1, 1))[..., None])
    return out, lse.contiguous()


# ----------------------------------------------------------------------------------------------
# Backward.
# ----------------------------------------------------------------------------------------------
def _mask_grad(dmask_full, attn_mask):
    return dmask_full.sum_to_size(attn_mask.shape).to(attn_mask.dtype).contiguous()


FLOOR_ROWS_REASON = ("a row sees only keys masked by a huge finite bias (e.g. finfo.min padding): its forward is "
                     "the uniform average, and the memory-efficient backward cannot rebuild those probabilities "
                     "from a float32 lse of about -1e30 (log(#keys) is below its rounding)")


def _has_floor_biased_rows(attn_mask, is_causal: bool, sliding_window: int, sq: int) -> bool:
    """Whether some row's visible keys all carry a finite bias at or below ``sdpa.FLOOR_ROW_BIAS``.

    Such rows (Hugging Face pads with ``finfo.min``; the kernels see -1e30) attend uniformly in the
    forward, as eager does, but their lse rounds to the bias and loses ``log(#keys)``, so the
    memory-efficient backward would weigh every key 1 instead of 1 / #keys. Checked from the mask
    alone (one reduction over it, one host sync); float16 masks cannot hold such biases."""
    if attn_mask is None or attn_mask.dtype not in (torch.float32, torch.bfloat16):
        return False
    m = attn_mask.float()
    sk = m.shape[-1]
    if is_causal:  # keys the causal / sliding-window rule hides do not count (bottom-right aligned)
        i = torch.arange(sq, device=m.device)[:, None] + (sk - sq)
        j = torch.arange(sk, device=m.device)[None, :]
        hidden = j > i
        if sliding_window > 0:
            hidden |= j <= i - sliding_window
        m = m.masked_fill(hidden, float("-inf"))
    row_max = m.amax(dim=-1)
    return bool(((row_max <= sdpa.FLOOR_ROW_BIAS) & (row_max > float("-inf"))).any())


def _row_delta(out, grad_out):
    if not triton_unavailable():
        from kda_compile.ops.attention.triton_flash import triton_row_delta

        return triton_row_delta(out, grad_out)
    return torch.einsum("bhsd,bhsd->bhs", grad_out.float(), out.float())


def cuda_backward(grad_out, grad_lse, q, k, v, out, lse, rng, attn_mask, sinks, scale, softcap, dropout_p,
                  is_causal, sliding_window, mask_needs_grad):
    """(dq, dk, dv, dmask or None, dsinks or None); dq/dk/dv BSHD-stored in the inputs' dtypes."""
    grad_reason = _grad_reason(mask_needs_grad, grad_lse is not None)
    impl, why, trimmed = _plan(q, k, v, attn_mask, softcap, dropout_p, is_causal, sliding_window,
                               backward=True, grad_reason=grad_reason)
    if impl == "efficient" and _has_floor_biased_rows(trimmed[2], trimmed[3], trimmed[4], q.shape[2]):
        impl, why = "reference", FLOOR_ROWS_REASON
    if impl == "reference":
        if why:
            record_fallback("attention_backward", "reference", why)
        dq, dk, dv, dmask, dsinks = reference_backward(grad_out, grad_lse, q, k, v, attn_mask, sinks, scale,
                                                       softcap, dropout_p, is_causal, sliding_window, rng,
                                                       mask_needs_grad)
        return as_bshd(dq), as_bshd(dk), as_bshd(dv), dmask, dsinks
    if impl == "triton":
        from kda_compile.ops.attention.triton_flash import triton_attention_backward

        if why:
            record_fallback("attention_backward", "triton", why)
        dq, dk, dv, dmask_full, dsinks = triton_attention_backward(
            grad_out, grad_lse, q, k, v, out, lse, attn_mask, sinks, scale, softcap, dropout_p, is_causal,
            sliding_window, rng, mask_needs_grad)
        dmask = _mask_grad(dmask_full, attn_mask) if mask_needs_grad else None
        dsinks = None if dsinks is None else dsinks.to(sinks.dtype)
        return dq, dk, dv, dmask, dsinks

    k2, v2, m2, causal2, window2, kv_start = trimmed
    q2, k2, v2 = (_last_dim_contiguous(t) for t in (q, k2, v2))
    grad_out = as_bshd(grad_out)
    dsinks = None
    if sinks is not None:
        sink_logit = sinks.float().view(1, -1, 1)
        a = torch.sigmoid(lse - sink_logit)
        # 1 - a as sigmoid(sink - lse): no cancellation when a is close to 1.
        dsinks = (-(torch.sigmoid(sink_logit - lse) * _row_delta(out, grad_out)).sum(dim=(0, 2))).to(sinks.dtype)
        grad_out = as_bshd((grad_out * a[..., None]).to(grad_out.dtype))  # scaled in float32
    lse_k = torch.where(lse == float("-inf"), torch.full_like(lse, float("inf")), lse)
    dq, dk, dv = sdpa.sdpa_backward(impl, grad_out, q2, k2, v2, out, lse_k, m2, scale, causal2, window2)
    if kv_start > 0:  # keys trimmed off for the window get zero gradient
        dk = torch.cat([dk.new_zeros(*dk.shape[:2], kv_start, dk.shape[3]), dk], dim=2)
        dv = torch.cat([dv.new_zeros(*dv.shape[:2], kv_start, dv.shape[3]), dv], dim=2)
    return as_bshd(dq), as_bshd(dk), as_bshd(dv), None, dsinks
