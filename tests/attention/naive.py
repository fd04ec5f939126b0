"""Test oracle for the attention op: a float64 softmax written as plainly as possible, plus input
builders, a hypothesis strategy and the op-versus-oracle check shared by the attention test files.

The naive version materialises everything (repeat_kv, the [B, H, Sq, Sk] scores, a sink column
concatenated to the logits) and shares no code with ``ops/attention/reference.py``.
"""
from __future__ import annotations

import math

import torch

from kda_compile.ops.attention import attention, attention_with_lse
from kda_compile.testing import AttentionCase, assert_rel_close, attention_cases, make_attention_args


def naive_attention(q, k, v, *, attn_mask=None, is_causal=False, scale=None, softcap=None, sinks=None,
                    sliding_window=None, keep=None, dropout_p=0.0):
    """(out [B, H, Sq, Dv], lse [B, H, Sq]) in float64; lse includes the sink, as attention_with_lse's."""
    q, k, v = q.double(), k.double(), v.double()
    b, h, sq, d = q.shape
    sk = k.shape[2]
    group = h // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scale = d ** -0.5 if scale is None else scale
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    row = torch.arange(sq, device=q.device)[:, None]
    col = torch.arange(sk, device=q.device)[None, :]
    position = row + (sk - sq)  # bottom-right alignment
    blocked = torch.zeros(sq, sk, dtype=torch.bool, device=q.device)
    if is_causal:
        blocked |= col > position
        if sliding_window is not None:
            blocked |= col <= position - sliding_window
    s = s.masked_fill(blocked, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, -math.inf)
        else:
            s = s + attn_mask.double()
    logits = s
    if sinks is not None:
        logits = torch.cat([s, sinks.double().view(1, h, 1, 1).expand(b, h, sq, 1)], dim=-1)
    dead = (logits == -math.inf).all(dim=-1, keepdim=True)
    safe = torch.where(dead, torch.zeros_like(logits), logits)
    p = torch.where(dead, torch.zeros_like(safe), torch.softmax(safe, dim=-1))[..., :sk]
    if keep is not None:
        p = p * keep.double() / (1.0 - dropout_p)
    out = torch.matmul(p, v)
    lse = torch.where(dead[..., 0], torch.full_like(dead[..., 0], -math.inf, dtype=torch.float64),
                      torch.logsumexp(safe, dim=-1))
    return out, lse


Case = AttentionCase  # the fixed cases of the test files read better short


def make_inputs(case: Case, dtype, device="cpu", seed=0, requires_grad=False):
    """(query, key, value) and the keyword arguments of ``attention`` for a case."""
    kwargs = dict(make_attention_args(case, dtype, device, seed=seed, requires_grad=requires_grad))
    return (kwargs.pop("query"), kwargs.pop("key"), kwargs.pop("value")), kwargs


def grad_inputs(args, kwargs):
    """The tensors that require grad, by name (for comparing gradients)."""
    named = dict(query=args[0], key=args[1], value=args[2], attn_mask=kwargs["attn_mask"], sinks=kwargs["sinks"])
    return {n: t for n, t in named.items() if t is not None and t.requires_grad}


def assert_lse_close(actual, expected, tol, name="lse"):
    """-inf exactly where expected, finite elsewhere within ``tol`` (relative RMS)."""
    expected = expected.to(actual.device)
    inf = expected == -math.inf
    assert torch.equal(actual == -math.inf, inf), f"{name}: -inf positions differ"
    assert_rel_close(actual[~inf], expected[~inf], tol, name=name)


def cases(max_seq=9, head_dims=(4, 8, 16), value_dims=(4, 8, 12, 16)):
    """Random valid cases (``kda_compile.testing.attention_cases``) with Sq and Sk up to ``max_seq``."""
    return attention_cases(max_q_len=max_seq, max_kv_len=max_seq, head_dims=head_dims, value_dims=value_dims)


# Tolerances of the public op against this oracle (relative RMS error; NaN never passes).
OUT_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
GRAD_TOL = {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def _tolerance(table, dtype, device):
    tol = table[dtype]
    return 2 * tol if device.type == "cuda" and dtype == torch.float32 else tol


def check_against_naive(case, dtype, device, seed=0, grads=True, lse_grads=True):
    """The public op on a case against the oracle: out and lse of ``attention_with_lse``; gradients of
    query, key, value, a float mask and sinks through ``attention`` (the fast backward) and, with
    ``lse_grads``, through the lse of ``attention_with_lse`` (a different backward path)."""
    args, kwargs = make_inputs(case, dtype, device, seed, requires_grad=grads)
    out, lse = attention_with_lse(*args, **kwargs)
    ref_out, ref_lse = naive_attention(*args, **kwargs)
    assert out.shape == (case.b, case.h, case.sq, case.dv) and out.dtype == dtype
    assert lse.shape == (case.b, case.h, case.sq) and lse.dtype == torch.float32
    assert_rel_close(out, ref_out, _tolerance(OUT_TOL, dtype, device), name="out")
    assert_lse_close(lse, ref_lse, max(_tolerance(OUT_TOL, dtype, device), 1e-6))
    if not grads:
        return
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    g_out = torch.randn(out.shape, generator=gen, device=device, dtype=torch.float64)
    # lse is float32: draw its incoming gradient in float32 so both sides see the same numbers.
    g_lse = torch.randn(lse.shape, generator=gen, device=device, dtype=torch.float32).double()
    finite = torch.isfinite(ref_lse)  # a -inf lse has no gradient to carry
    leaves = grad_inputs(args, kwargs)
    grad_tol = _tolerance(GRAD_TOL, dtype, device)
    checks = [("out", grad_tol)] + ([("lse", max(grad_tol, 1e-5))] if lse_grads and finite.any() else [])
    # An exactly-zero expected gradient (d query with a single key: p = 1) comes back from CUDA kernels
    # as the rounding noise of two separately rounded terms (dO.v - dO.o), about 1e-6 absolute in
    # fp32; on CPU the reference math cancels exactly. The floor is the smallest denominator.
    floor = 1e-6 if torch.device(device).type == "cpu" else 5e-2
    for source, tol in checks:  # lse is float32, so gradients through it carry float32 rounding
        if source == "out":
            got = torch.autograd.grad(attention(*args, **kwargs), list(leaves.values()), g_out.to(dtype))
            expected = torch.autograd.grad((ref_out * g_out).sum(), list(leaves.values()), retain_graph=True)
        else:
            got = torch.autograd.grad(lse, list(leaves.values()), g_lse.float(), allow_unused=True)
            expected = torch.autograd.grad((ref_lse[finite] * g_lse[finite]).sum(), list(leaves.values()),
                                           allow_unused=True)
        for name, g, e in zip(leaves, got, expected):
            g = torch.zeros_like(leaves[name]) if g is None else g
            e = torch.zeros_like(leaves[name], dtype=torch.float64) if e is None else e
            assert g.shape == leaves[name].shape, name
            assert_rel_close(g, e, tol, name=f"d{name} (through {source})", floor=floor)
