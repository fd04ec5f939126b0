"""Public entry points ``attention`` and ``attention_with_lse``: argument checks, then the custom op.

Both are plain Python over one ``torch.ops.kda_compile.attention_fwd`` call, so Dynamo traces them
without a graph break and the op's ``register_autograd`` supplies the backward.
"""
from __future__ import annotations

import math
import numbers

import torch

from kda_compile.ops._argument_errors import deferred_error, sizes
from kda_compile.ops._common import arg_error, check_attn_mask, check_tensor, describe, gradients_needed, shown
from kda_compile.ops.attention import custom_ops  # noqa: F401  (registers torch.ops.kda_compile.attention_*)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Softmax attention, fused: no [Sq, Sk] score matrix on CUDA.

    Args:
        query: [B, H, Sq, Dqk]; key: [B, Hkv, Sk, Dqk]; value: [B, Hkv, Sk, Dv]. float16, bfloat16,
            float32 or float64, one dtype and device; any strides (transposed views are fine).
            ``H % Hkv == 0`` (GQA/MQA: K/V are never repeated); ``Dv`` may differ from ``Dqk``.
        attn_mask: None, a bool tensor (True = attend) or a float tensor added to the scores,
            broadcastable to [B, H, Sq, Sk]. A float mask that requires grad gets a gradient.
        is_causal: causal mask aligned bottom-right: query row ``i`` is at absolute position
            ``Sk - Sq + i`` and sees keys ``j <= Sk - Sq + i`` (the KV-cache convention).
        scale: score scale, default ``Dqk ** -0.5``: ``s = scale * q . k``.
        softcap: None or > 0; Gemma 2's ``s = softcap * tanh(s / softcap)``, applied before any mask.
        sinks: None or a [H] tensor (gpt-oss): one logit per head joining only the softmax
            denominator, ``p_j = exp(s_j) / (sum_k exp(s_k) + exp(sink_h))``. Gets a gradient.
        dropout_p: dropout on the probabilities (training), in [0, 1).
        sliding_window: None or W >= 1, only with ``is_causal``: a row at position p sees keys
            ``p - W < j <= p``.

    ``is_causal``/``sliding_window`` may be combined with ``attn_mask`` (the mask applies on top).
    Rows whose keys are all masked out (mask False or -inf) return 0, never NaN. Sk = 0 is the same: a
    softmax over zero keys returns 0 (lse -inf); Sq = 0 and B = 0 return empty outputs (as the KDA ops'
    T = 0); gradients are zeros. H, Dqk and Dv must be >= 1.

    Bad arguments raise ``ValueError`` / ``TypeError`` naming the argument, its value and what is accepted,
    eagerly and, unchanged, from a ``torch.compile(fullgraph=True)`` function when it runs
    (docs/op-input-errors.md).

    Returns:
        out [B, H, Sq, Dv] in the query dtype (stored as [B, Sq, H, Dv], so
        ``out.transpose(1, 2).reshape(B, Sq, H * Dv)`` is free).
    """
    out, _ = _attention(query, key, value, attn_mask, is_causal, scale, softcap, sinks, dropout_p,
                        sliding_window, want_lse=False)
    return out


def attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention`` that also returns the log-sum-exp of each row.

    Returns:
        (out, lse): out as in ``attention``; lse [B, H, Sq] float32, the natural log of the softmax
        denominator, ``log(sum_j exp(s_j) [+ exp(sink_h)])`` (-inf for a row with nothing to attend
        and no sink). Gradients flow through lse as well (computed by the Triton kernel on CUDA).
    """
    return _attention(query, key, value, attn_mask, is_causal, scale, softcap, sinks, dropout_p, sliding_window,
                      want_lse=True)


def _attention(query, key, value, attn_mask, is_causal, scale, softcap, sinks, dropout_p, sliding_window, *,
               want_lse: bool):
    try:
        scale, softcap, dropout_p, window = _check_arguments(query, key, value, attn_mask, is_causal, scale,
                                                             softcap, sinks, dropout_p, sliding_window)
    except (ValueError, TypeError) as error:
        return _deferred(error, query, value)
    differentiable = gradients_needed(query, key, value, attn_mask, sinks)
    out, lse, _ = torch.ops.kda_compile.attention_fwd(query, key, value, attn_mask, sinks, scale, softcap,
                                                      dropout_p, bool(is_causal), window, want_lse and differentiable)
    if want_lse and sinks is not None:
        lse = torch.logaddexp(lse, sinks.float().view(1, -1, 1))
    return out, lse


def _deferred(error, query, value):
    """``(out, lse)`` for a call with a bad argument: ``error`` raised now (eager) or when the compiled function
    runs (``ops._argument_errors``), with placeholders of the real outputs' shapes and layout where the
    arguments say them, so that Dynamo traces the caller's code after the call."""
    q, v = sizes(query, 4), sizes(value, 4)
    if q is None or v is None:
        return deferred_error(error, query)
    b, h, sq, _ = q
    out, lse = deferred_error(error, query, (b, sq, h, v[3]), (b, h, sq))
    return out.transpose(1, 2), lse


def _number(name, value, accepted):
    """A finite Python float from a real number; bools refused. A symbolic size is specialised; a
    symbolic float (traced arithmetic) passes through unchecked."""
    if isinstance(value, torch.SymFloat):
        return value
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.SymInt)):
        raise arg_error(name, shown(value), accepted, kind=TypeError)
    value = float(int(value)) if isinstance(value, torch.SymInt) else float(value)
    if not -math.inf < value < math.inf:  # also False for NaN; comparisons trace where math.isfinite does not
        raise arg_error(name, value, accepted)
    return value


def _check_arguments(query, key, value, attn_mask, is_causal, scale, softcap, sinks, dropout_p, sliding_window):
    """Validate everything the op relies on; return (scale, softcap, dropout_p, window) normalised."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t, ndim=4, dtypes=_DTYPES)
    b, h, sq, dqk = query.shape
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise arg_error(name, describe(t), f"of the query's dtype {query.dtype}", kind=TypeError)
        if t.device != query.device:
            raise arg_error(name, describe(t), f"on the query's device {query.device}")
        if t.shape[0] != b:
            raise arg_error(name, describe(t), f"a tensor of the query's batch size {b}")
    hkv, sk = key.shape[1], key.shape[2]
    if value.shape[1] != hkv or value.shape[2] != sk:
        raise arg_error("value", describe(value), f"[B, Hkv, Sk, Dv] with Hkv = {hkv} and Sk = {sk} like key")
    if h < 1 or dqk < 1:  # Sq = 0, Sk = 0 and B = 0 are fine: empty or zero outputs (docs/op-input-errors.md)
        raise arg_error("query", describe(query), "a [B, H, Sq, Dqk] tensor with H >= 1 heads of width Dqk >= 1")
    if hkv == 0 or h % hkv != 0:
        raise arg_error("key", describe(key), f"a number of heads dividing the query's {h} heads")
    if key.shape[3] != dqk:
        raise arg_error("key", describe(key), f"head dim {dqk} like the query")
    if value.shape[3] < 1:
        raise arg_error("value", describe(value), "a [B, Hkv, Sk, Dv] tensor with Dv >= 1")
    check_attn_mask(attn_mask, (b, h, sq, sk), query.device, device_owner="the query", dims="[B, H, Sq, Sk]")
    if not isinstance(is_causal, bool):
        raise arg_error("is_causal", shown(is_causal), "a bool", kind=TypeError)
    # int(): a symbolic head dim (dynamic=True) is specialised; head dims do not vary between calls.
    scale = int(dqk) ** -0.5 if scale is None else _number("scale", scale, "a finite float")
    if softcap is None:
        softcap = 0.0
    else:
        softcap = _number("softcap", softcap, "None or a finite float > 0")
        if softcap <= 0.0:
            raise arg_error("softcap", softcap, "None or a finite float > 0")
    dropout_p = _number("dropout_p", dropout_p, "a float in [0, 1)")
    if not 0.0 <= dropout_p < 1.0:
        raise arg_error("dropout_p", dropout_p, "a float in [0, 1)")
    window = 0
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, (int, torch.SymInt)):
            raise arg_error("sliding_window", shown(sliding_window), "None or an int >= 1", kind=TypeError)
        if sliding_window < 1:
            raise arg_error("sliding_window", sliding_window, "None or an int >= 1")
        if not is_causal:
            raise arg_error("sliding_window", sliding_window, "None unless is_causal=True")
        window = int(sliding_window)
    if sinks is not None:
        check_tensor("sinks", sinks, ndim=1)
        if not sinks.is_floating_point():
            raise arg_error("sinks", describe(sinks), f"a floating-point [H] = [{h}] tensor on {query.device}",
                            kind=TypeError)
        if sinks.shape[0] != h or sinks.device != query.device:
            raise arg_error("sinks", describe(sinks), f"a floating-point [H] = [{h}] tensor on {query.device}")
    return scale, softcap, dropout_p, window
