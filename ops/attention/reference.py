"""Reference softmax attention in plain torch: the definition every kernel is tested against.

Runs on any device and is what runs on CPU. It materialises the [B, H, Sq, Sk] scores, so the CUDA
dispatcher uses it only for float64 (a test dtype) or when no fast path exists, and logs that.

Semantics (shared by every backend of ``kda_compile::attention_fwd``):

- ``s = scale * q . k``; with ``softcap``: ``s = softcap * tanh(s / softcap)`` (Gemma 2), before any mask.
- ``is_causal`` is aligned bottom-right: query row ``i`` sits at absolute position ``p = Sk - Sq + i`` and
  sees keys ``j <= p``; ``sliding_window = W`` (with ``is_causal`` only) also requires ``j > p - W``.
- ``attn_mask``: bool (True = attend) or float (added to ``s``), broadcastable to [B, H, Sq, Sk]; a key
  is *masked out* when the bool mask is False or the float mask is ``-inf``. Finite values, however
  negative, are added as numbers.
- ``sinks`` [H]: one logit per head that joins only the denominator:
  ``p_j = exp(s_j) / (sum_k exp(s_k) + exp(sink_h))``.
- dropout on the probabilities, kept entries scaled by ``1 / (1 - dropout_p)``.
- A row whose keys are all masked out produces 0 (never NaN); its ``lse`` is ``-inf``.
- ``lse`` returned here is the log-sum-exp of the scores only, ``log(sum_j exp(s_j))`` (float32),
  without the sink; the public ``attention_with_lse`` adds the sink with ``logaddexp``.

GQA is computed by folding the query heads of a group into the row dimension
([B, Hkv, G * Sq, D]), so keys and values are never repeated.
"""
from __future__ import annotations

import torch

from kda_compile.ops._common import autograd_inside_op


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the reference computes in: at least float32."""
    return torch.promote_types(dtype, torch.float32)


def allowed_positions(sq: int, sk: int, is_causal: bool, sliding_window: int, device) -> torch.Tensor | None:
    """Bool [Sq, Sk] of the keys each query row may see under the causal / window flags (None: all).

    Reference and tests only: the CUDA kernels apply these flags without building this matrix.
    """
    if not is_causal:
        return None
    pos = torch.arange(sq, device=device)[:, None] + (sk - sq)
    key = torch.arange(sk, device=device)[None, :]
    allowed = key <= pos
    if sliding_window > 0:
        allowed = allowed & (key > pos - sliding_window)
    return allowed


def dropout_keep_mask(rng: torch.Tensor, shape, p: float, device) -> torch.Tensor:
    """The keep-mask of the reference dropout, regenerated identically from the op's ``rng`` seed."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int(rng[0]))
    return torch.rand(shape, generator=gen, device=device, dtype=torch.float32) >= p


def _scores(q, k, scale: float, softcap: float):
    """scale * q . k without repeating K: q [B, H, Sq, D], k [B, Hkv, Sk, D] -> [B, H, Sq, Sk]."""
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = h // hkv
    s = torch.matmul(q.reshape(b, hkv, group * sq, d), k.transpose(-1, -2)) * scale
    s = s.reshape(b, h, sq, sk)
    if softcap > 0.0:
        s = torch.tanh(s / softcap) * softcap
    return s


def _apply_masks(s, attn_mask, is_causal: bool, sliding_window: int):
    sq, sk = s.shape[-2], s.shape[-1]
    allowed = allowed_positions(sq, sk, is_causal, sliding_window, s.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask.to(s.dtype)
    return s


def reference_forward_math(q, k, v, attn_mask, sinks, scale: float, softcap: float, dropout_p: float,
                           is_causal: bool, sliding_window: int, keep=None):
    """Differentiable reference in the compute dtype.

    Shapes: q [B, H, Sq, Dqk], k [B, Hkv, Sk, Dqk], v [B, Hkv, Sk, Dv], attn_mask broadcastable to
    [B, H, Sq, Sk], sinks [H], keep (dropout keep-mask) [B, H, Sq, Sk] or None.
    Returns out [B, H, Sq, Dv] and lse [B, H, Sq], both in the compute dtype.
    """
    ct = compute_dtype(q.dtype)
    b, h, sq, _ = q.shape
    hkv, sk, dv = v.shape[1], v.shape[2], v.shape[3]
    s = _apply_masks(_scores(q.to(ct), k.to(ct), scale, softcap), attn_mask, is_causal, sliding_window)
    # The row max only shifts the exponent; detaching it keeps autograd exact (it cancels analytically).
    row_max = s.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
    e = torch.exp(s - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    lse_scores = denom
    if sinks is not None:
        denom = denom + torch.exp(sinks.to(ct).view(1, h, 1, 1) - row_max)
    # Rows with nothing to attend: e == 0 there, so dividing by 1 gives 0 without a NaN (and without
    # a NaN gradient through the branch torch.where would discard).
    p = e / torch.where(denom > 0, denom, torch.ones_like(denom))
    if dropout_p > 0.0:
        p = p * keep.to(ct) / (1.0 - dropout_p)
    group = h // hkv
    out = torch.matmul(p.reshape(b, hkv, group * sq, sk), v.to(ct)).reshape(b, h, sq, dv)
    alive = lse_scores > 0
    safe = torch.where(alive, lse_scores, torch.ones_like(lse_scores))
    lse = torch.where(alive, row_max + torch.log(safe), torch.full_like(safe, float("-inf")))
    return out, lse.squeeze(-1)


def new_dropout_seed(dropout_p: float, device) -> torch.Tensor:
    """The op's ``rng`` output: int64 [2] (seed, unused) on the inputs' device when dropout is on,
    else empty. Kernels read the seed from device memory, so drawing it never synchronises."""
    if dropout_p > 0.0:
        return torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64, device=device)
    return torch.empty(0, dtype=torch.int64, device=device)


def reference_forward(q, k, v, attn_mask, sinks, scale, softcap, dropout_p, is_causal, sliding_window, rng):
    """Forward of the op on the reference path: out [B, H, Sq, Dv] (query dtype), lse [B, H, Sq] fp32."""
    keep = None
    if dropout_p > 0.0:
        b, h, sq, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        keep = dropout_keep_mask(rng, (b, h, sq, sk), dropout_p, q.device)
    with torch.no_grad():
        out, lse = reference_forward_math(q, k, v, attn_mask, sinks, scale, softcap, dropout_p,
                                          is_causal, sliding_window, keep)
    return out.to(q.dtype), lse.float()


def reference_backward(grad_out, grad_lse, q, k, v, attn_mask, sinks, scale, softcap, dropout_p,
                       is_causal, sliding_window, rng, mask_needs_grad: bool):
    """Gradients by differentiating the reference forward (recomputed with the same dropout mask).

    Returns (dq, dk, dv, dmask or None, dsinks or None) in the dtypes of the inputs.
    """
    ct = compute_dtype(q.dtype)
    leaves = [t.detach().to(ct).requires_grad_(True) for t in (q, k, v)]
    mask_leaf = attn_mask
    if mask_needs_grad:
        mask_leaf = attn_mask.detach().to(ct).requires_grad_(True)
    sinks_leaf = None if sinks is None else sinks.detach().to(ct).requires_grad_(True)
    keep = None
    if dropout_p > 0.0:
        b, h, sq, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        keep = dropout_keep_mask(rng, (b, h, sq, sk), dropout_p, q.device)
    wrt = leaves + ([mask_leaf] if mask_needs_grad else []) + ([sinks_leaf] if sinks is not None else [])
    with autograd_inside_op():
        out, lse = reference_forward_math(*leaves, mask_leaf, sinks_leaf, scale, softcap, dropout_p,
                                          is_causal, sliding_window, keep)
        outputs, grads = [out], [grad_out.to(ct)]
        if grad_lse is not None:
            # Rows with lse = -inf have no dependence on the inputs; their incoming gradient is ignored.
            outputs.append(lse)
            grads.append(torch.where(torch.isfinite(lse), grad_lse.to(ct), torch.zeros_like(lse)))
        got = torch.autograd.grad(outputs, wrt, grads, allow_unused=True)
    got = [torch.zeros_like(w) if g is None else g for g, w in zip(got, wrt)]
    dq, dk, dv = (g.to(t.dtype) for g, t in zip(got[:3], (q, k, v)))
    rest = got[3:]
    dmask = rest.pop(0).to(attn_mask.dtype) if mask_needs_grad else None
    dsinks = rest.pop(0).to(sinks.dtype) if sinks is not None else None
    return dq, dk, dv, dmask, dsinks
