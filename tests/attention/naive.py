"""Test oracle for the attention op: a float64 softmax written as plainly as possible, plus input
builders, a hypothesis strategy and the op-versus-oracle check shared by the attention test files.

The naive version materialises everything (repeat_kv, the [B, H, Sq, Sk] scores, a sink column
concatenated to the logits) and shares no code with ``ops/attention/reference.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from hypothesis import strategies as st

from kda_compile.ops.attention import attention, attention_with_lse
from kda_compile.testing import assert_rel_close

MASK_KINDS = ("none", "bool", "float", "float_inf")
MASK_SHAPES = ("full", "b1", "11", "2d", "row")  # [B,H,Sq,Sk], [B,1,Sq,Sk], [1,1,Sq,Sk], [Sq,Sk], [B,1,1,Sk]


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


@dataclass(frozen=True)
class Case:
    b: int = 1
    h: int = 2
    hkv: int = 2
    sq: int = 5
    sk: int = 5
    dqk: int = 16
    dv: int = 16
    causal: bool = False
    window: int | None = None
    mask: str = "none"
    mask_shape: str = "full"
    softcap: float | None = None
    sinks: bool = False
    scale: float | None = None
    dead_rows: bool = False
    noncontiguous: bool = False

    def with_(self, **kw):
        return replace(self, **kw)


def _mask(case: Case, dtype, device, gen):
    shape = {"full": (case.b, case.h, case.sq, case.sk), "b1": (case.b, 1, case.sq, case.sk),
             "11": (1, 1, case.sq, case.sk), "2d": (case.sq, case.sk), "row": (case.b, 1, 1, case.sk)}[case.mask_shape]
    if case.mask == "bool":
        m = torch.rand(shape, generator=gen, device=device) > 0.3
        if case.dead_rows:
            m[..., 0, :] = False
        return m
    m = torch.randn(shape, generator=gen, device=device, dtype=torch.float64)
    if case.mask == "float_inf":
        m = m.masked_fill(torch.rand(shape, generator=gen, device=device) < 0.3, -math.inf)
    if case.dead_rows:
        m[..., 0, :] = -math.inf
    return m.to(dtype)


def make_inputs(case: Case, dtype, device="cpu", seed=0, requires_grad=False):
    """(query, key, value) and the keyword arguments of ``attention`` for a case."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float64)

    if case.noncontiguous:  # [B, S, H, D] storage seen as [B, H, S, D]; K and V slices of one tensor
        q = randn(case.b, case.sq, case.h, case.dqk).transpose(1, 2)
        kv = randn(case.b, case.sk, case.hkv, case.dqk + case.dv).transpose(1, 2)
        k, v = kv[..., :case.dqk], kv[..., case.dqk:]
    else:
        q, k, v = randn(case.b, case.h, case.sq, case.dqk), randn(case.b, case.hkv, case.sk, case.dqk), \
            randn(case.b, case.hkv, case.sk, case.dv)
    q, k, v = (t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v))
    mask = None if case.mask == "none" else _mask(case, dtype, device, gen)
    if mask is not None and mask.is_floating_point():
        mask.requires_grad_(requires_grad)
    sinks = None
    if case.sinks:
        sinks = (2.0 * randn(case.h)).to(dtype).requires_grad_(requires_grad)
    kwargs = dict(attn_mask=mask, is_causal=case.causal, scale=case.scale, softcap=case.softcap, sinks=sinks,
                  sliding_window=case.window)
    return (q, k, v), kwargs


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


@st.composite
def cases(draw, max_seq=9, head_dims=(4, 8, 16), value_dims=(4, 8, 12, 16)):
    """Random valid cases: GQA ratios, Dv != Dqk, masks and their broadcasts, causal + window, softcap,
    sinks, Sq != Sk, Sq = 1, Sk = 1, fully masked rows, transposed inputs."""
    hkv = draw(st.integers(1, 3))
    causal = draw(st.booleans())
    mask = draw(st.sampled_from(MASK_KINDS))
    return Case(
        b=draw(st.integers(1, 2)), hkv=hkv, h=hkv * draw(st.integers(1, 3)),
        sq=draw(st.integers(1, max_seq)), sk=draw(st.integers(1, max_seq)),
        dqk=draw(st.sampled_from(head_dims)), dv=draw(st.sampled_from(value_dims)),
        causal=causal, window=draw(st.one_of(st.none(), st.integers(1, 6))) if causal else None,
        mask=mask, mask_shape=draw(st.sampled_from(MASK_SHAPES)),
        softcap=draw(st.sampled_from([None, 1.5, 20.0])), sinks=draw(st.booleans()),
        scale=draw(st.sampled_from([None, 0.3])), dead_rows=mask != "none" and draw(st.booleans()),
        noncontiguous=draw(st.booleans()),
    )


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
