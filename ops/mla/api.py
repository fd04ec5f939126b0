"""Public entry points: ``mla_attention`` (argument checks, then one custom-op call) and
``explain_mla_path`` (which form a call would take, and the estimate behind it).

``mla_attention`` is plain Python around ``torch.ops.kda_compile.mla_attention_fwd``, so Dynamo traces
it without a graph break and the op's ``register_autograd`` supplies the backward.
"""
from __future__ import annotations

import torch

from kda_compile.ops._argument_errors import deferred_error, sizes
from kda_compile.ops._common import arg_error, check_attn_mask, check_tensor, describe, plain, positive_scale, shown
from kda_compile.ops.mla import custom_ops  # noqa: F401  (registers torch.ops.kda_compile.mla_attention_*)
from kda_compile.ops.mla.path_choice import PATHS, PathCost, choose_path, estimate

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_latent: torch.Tensor,
    k_rope: torch.Tensor,
    kv_b_weight: torch.Tensor,
    *,
    scale: float,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    path: str = "auto",
) -> torch.Tensor:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Kimi-Linear) from the latent KV cache.

    Computes exactly what Hugging Face's ``expand_kv`` + attention compute (docs/mla.md §2), without
    necessarily expanding: per call it takes the absorbed form (MQA over the latent, d_qk = R + Dr,
    d_v = R; the Triton split-KV kernel on CUDA) when the query is short next to the cache (decode,
    speculative steps, a short chunk against a long cache), else the expanded form (``kv_b_proj``
    over the cache + the fused attention op). The rule and its cost model: ``path_choice.py``.

    Args:
        q_nope: [B, H, Sq, Dn], the non-rotary part of the query (128 in DeepSeek/Kimi models).
        q_rope: [B, H, Sq, Dr], the rotary part, rotary already applied (64; Kimi-Linear: unrotated).
            Any strides: Hugging Face's split views of the transposed query are taken as they are.
        kv_latent: [B, T, R] or Hugging Face's cached [B, 1, T, R]: the normalised latent
            (``kv_a_layernorm`` output, R = kv_lora_rank = 512) of every cached token.
        k_rope: [B, T, Dr] or [B, 1, T, Dr]: the shared rope key of every cached token.
        kv_b_weight: ``kv_b_proj.weight``, [H * (Dn + Dv), R]; Dv is inferred from it.
            All five tensors share one dtype (float16, bfloat16, float32, float64) and device.
        scale: the softmax scale, required: Hugging Face's ``module.scaling``, i.e.
            ``(Dn + Dr) ** -0.5`` times ``mscale ** 2`` under YaRN (never ``(R + Dr) ** -0.5``).
        attn_mask: None, bool (True = attend) or additive float (Hugging Face's eager masks, with
            ``finfo.min`` for padding), broadcastable to [B, H, Sq, T]. A float mask that requires
            grad gets a gradient.
        is_causal: query i sits at position ``T - Sq + i`` and sees keys ``t <= T - Sq + i``
            (bottom-right, the KV-cache convention). May be combined with ``attn_mask``.
        path: "auto" (per call, by the cost model), "absorbed" or "expanded" (tests, benchmarks).

    Rows whose keys are all masked out (False or -inf) return 0, never NaN; so does T = 0 (a softmax over
    zero keys), and Sq = 0 / B = 0 return an empty output (gradients: zeros). H, Dn, Dr and R must be >= 1.
    Bad arguments raise ``ValueError`` / ``TypeError`` naming the argument, its value and what is accepted,
    eagerly and, unchanged, from a ``torch.compile(fullgraph=True)`` function when it runs
    (docs/op-input-errors.md).

    Returns:
        out [B, H, Sq, Dv] in the input dtype, stored as [B, Sq, H, Dv], so
        ``out.transpose(1, 2).reshape(B, Sq, H * Dv)`` (what feeds ``o_proj``) is free.
    """
    try:
        q_nope, q_rope, kv_latent, k_rope, kv_b_weight, scale = _check_arguments(
            q_nope, q_rope, kv_latent, k_rope, kv_b_weight, scale, attn_mask, is_causal, path)
    except (ValueError, TypeError) as error:
        return _deferred(error, q_nope, kv_b_weight)
    return torch.ops.kda_compile.mla_attention_fwd(q_nope, q_rope, kv_latent, k_rope, kv_b_weight, attn_mask,
                                                   scale, is_causal, path)


def explain_mla_path(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_latent: torch.Tensor,
    k_rope: torch.Tensor,
    kv_b_weight: torch.Tensor,
    *,
    is_causal: bool = False,
    path: str = "auto",
) -> tuple[str, str, PathCost]:
    """(form, reason, cost): the form ("absorbed" or "expanded") ``mla_attention`` would take for
    these inputs, why, and the :class:`PathCost` estimate behind an "auto" choice."""
    q_nope, q_rope, kv_latent, k_rope, kv_b_weight, _ = _check_arguments(
        q_nope, q_rope, kv_latent, k_rope, kv_b_weight, 1.0, None, is_causal, path)
    shape = custom_ops.mla_shape(q_nope, q_rope, kv_latent, kv_b_weight, is_causal)
    form, reason = choose_path(path, shape)
    cost: PathCost = estimate(shape)
    return form, reason, cost


def _deferred(error, q_nope, kv_b_weight):
    """The output of a call with a bad argument: ``error`` raised now (eager) or when the compiled function
    runs (``ops._argument_errors``), with a placeholder of the real output's shape and layout where the
    arguments say it, so that Dynamo traces the caller's code after the call."""
    q, w = sizes(q_nope, 4), sizes(kv_b_weight, 2)
    if q is None or w is None or q[1] < 1 or w[0] % q[1] != 0:
        return deferred_error(error, q_nope)[0]
    b, h, sq, dn = q
    return deferred_error(error, q_nope, (b, sq, h, max(w[0] // h - dn, 0)))[0].transpose(1, 2)


def _squeeze_head(name: str, t):
    """[B, 1, T, D] (Hugging Face's single-head cache layout) -> [B, T, D]; [B, T, D] as it is."""
    check_tensor(name, t, dtypes=_DTYPES)
    if t.dim() == 4 and t.shape[1] == 1:
        return t.squeeze(1)
    if t.dim() != 3:
        raise arg_error(name, describe(t), "a [B, T, D] or [B, 1, T, D] tensor")
    return t


def _check_arguments(q_nope, q_rope, kv_latent, k_rope, kv_b_weight, scale, attn_mask, is_causal, path):
    check_tensor("q_nope", q_nope, ndim=4, dtypes=_DTYPES)
    check_tensor("q_rope", q_rope, ndim=4, dtypes=_DTYPES)
    kv_latent = _squeeze_head("kv_latent", kv_latent)
    k_rope = _squeeze_head("k_rope", k_rope)
    check_tensor("kv_b_weight", kv_b_weight, ndim=2, dtypes=_DTYPES)
    b, h, sq, dn = q_nope.shape
    for name, t in (("q_rope", q_rope), ("kv_latent", kv_latent), ("k_rope", k_rope), ("kv_b_weight", kv_b_weight)):
        if t.dtype != q_nope.dtype:
            raise arg_error(name, describe(t), f"of q_nope's dtype {q_nope.dtype}", kind=TypeError)
        if t.device != q_nope.device:
            raise arg_error(name, describe(t), f"on q_nope's device {q_nope.device}")
    if q_rope.shape[:3] != q_nope.shape[:3]:
        raise arg_error("q_rope", describe(q_rope),
                        f"[B, H, Sq, Dr] with [B, H, Sq] = {plain(q_nope.shape[:3])} as q_nope")
    t_len, r = kv_latent.shape[1], kv_latent.shape[2]
    if kv_latent.shape[0] != b:
        raise arg_error("kv_latent", describe(kv_latent), f"batch size {b} as q_nope")
    if k_rope.shape[0] != b or k_rope.shape[1] != t_len or k_rope.shape[2] != q_rope.shape[3]:
        raise arg_error("k_rope", describe(k_rope),
                        f"[B, T, Dr] = [{b}, {t_len}, {q_rope.shape[3]}] (kv_latent's B and T, q_rope's Dr)")
    # Sq = 0, T = 0 and B = 0 are fine: empty or zero outputs (docs/op-input-errors.md).
    if h < 1 or dn < 1:
        raise arg_error("q_nope", describe(q_nope), "a [B, H, Sq, Dn] tensor with H >= 1 heads of width Dn >= 1")
    if q_rope.shape[3] < 1:
        raise arg_error("q_rope", describe(q_rope), "a [B, H, Sq, Dr] tensor with Dr >= 1")
    if r < 1:
        raise arg_error("kv_latent", describe(kv_latent), "a [B, T, R] tensor with R >= 1")
    rows = kv_b_weight.shape[0]
    if kv_b_weight.shape[1] != r or rows % h != 0 or rows // h <= dn:
        raise arg_error("kv_b_weight", describe(kv_b_weight),
                        f"[H * (Dn + Dv), R] with H = {h}, Dn = {dn}, Dv >= 1 and R = {r} (kv_latent's last dim)")
    check_attn_mask(attn_mask, (b, h, sq, t_len), q_nope.device, device_owner="q_nope", dims="[B, H, Sq, T]")
    if not isinstance(is_causal, bool):
        raise arg_error("is_causal", shown(is_causal), "a bool", kind=TypeError)
    if not isinstance(path, str) or path not in PATHS:
        raise arg_error("path", shown(path), f"one of {PATHS}")
    return q_nope, q_rope, kv_latent, k_rope, kv_b_weight, positive_scale(scale)
