"""The FLA backend's glue on CPU: ``fla_backend.FLABackend`` driven by a stand-in for FLA's internal
functions, so the op layer's side of that path (the q/k L2 norm and beta sigmoid around FLA's kernels,
their backward chain, residual shapes and the zeroed triangles, dtype conversions, which gradient is
which, what autograd keeps alive) is checked without CUDA. The L2 norm and the triangle zeroing are our
own Triton kernels (``backends/fla_glue.py``), which run here under the Triton interpreter. The real FLA
kernels are checked on the GPU box (tests marked ``cuda``).

The stand-in follows fla-core 0.6's contracts as its source writes them: ``fused_beta_sigmoid_fwd``
returns float32; the gate cumsums are chunk-local, float32, in log2 units; ``chunk_kda_fwd_intra`` returns
``(w, u, qg, kg, Aqk, Akk)`` in FLA's formats (``fla_formats.py``), on which our scan kernel runs (under the
interpreter here); ``chunk_kda_fwd`` (the whole forward, for calls our scan does not take)
returns ``(o, final, g_cumsum, Aqk, Akk, ...)`` with ``g_cumsum`` None
under the in-kernel gate and ``Aqk`` / ``Akk`` ``[B, T, HV, chunk]`` written on and below the diagonal only:
``Akk`` is allocated zero-filled, ``Aqk`` is not (the stand-in fills its rest with fresh noise, as FLA leaves
whatever the allocator held); ``chunk_kda_bwd``
takes the normalised q/k and the activated beta and returns ``(dq, dk, dv, dbeta, dg, dh0, dA_log,
ddt_bias)``. Its math is our reference (fp64 here), so the op on this path must match the reference
path: relative error < 1e-6 in float64 (the L2 norm, FLA's activated beta and rstd are float32; see TOL).
"""
from __future__ import annotations

import types

import pytest
import torch

from kda_compile.ops import chunk_kda
from kda_compile.ops._common import autograd_inside_op
from kda_compile.ops.kda.backends import fla as fla_backend
from kda_compile.ops.kda.backends.registry import only_backends
from kda_compile.ops.kda.reference import kda_gate, kda_reference
from kda_compile.testing import KDAShape, assert_rel_close, make_kda_args
from triton_device import triton_device

from .fla_formats import LN2, chunk_spans, intra, local_cumsum, states

DEVICE = triton_device("the FLA path's Triton glue kernels")

# float64 on both paths, but the L2 norm runs in float32 and FLA's activated beta is float32 (their
# contract); a plumbing mistake (a gradient of the wrong input, a missing chain rule) is O(1).
TOL = 1e-6
# What our scan kernel computes (o, the final state, and v_new / h when kept): float32 products under the
# interpreter; TF32 on CUDA (the stand-in lets float64 reach it, which real FLA refuses), 2^-11 per operand.
SCAN_TOL = TOL if DEVICE.type == "cpu" else 2e-3


class FakeFLA:
    """fla-core 0.6's internal functions as ``fla_backend`` calls them, in plain torch; counts calls."""

    def __init__(self):
        self.calls: dict[str, int] = {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def namespace(self) -> dict:
        return {name: getattr(self, name) for name in (
            "chunk_kda_fwd", "chunk_kda_bwd", "beta_sigmoid_fwd", "beta_sigmoid_bwd",
            "prepare_chunk_indices", "chunk_kda_fwd_intra", "kda_gate_chunk_cumsum", "chunk_local_cumsum")}

    def kda_gate_chunk_cumsum(self, *, g, A_log, dt_bias, scale, lower_bound, chunk_size, cu_seqlens, chunk_indices):
        self._count("kda_gate_chunk_cumsum")
        return local_cumsum(kda_gate(g.double(), A_log, dt_bias, lower_bound), g.shape[1], cu_seqlens, chunk_size,
                            scale)

    def chunk_local_cumsum(self, *, g, scale, chunk_size, cu_seqlens, chunk_indices):
        self._count("chunk_local_cumsum")
        return local_cumsum(g, g.shape[1], cu_seqlens, chunk_size, scale)

    def chunk_kda_fwd_intra(self, *, q, k, v, gk, beta, scale, safe_gate, disable_recompute, chunk_size, cu_seqlens,
                            chunk_indices):
        self._count("chunk_kda_fwd_intra")
        assert disable_recompute, "our scan reads FLA's qg: the intra pass must be asked for it"
        result = intra(q, k, v, gk, beta, scale, cu_seqlens, chunk_size)
        self.kept, self.gate_cumsum = list(result[:4]), gk  # w, u, qg, kg
        return result

    @staticmethod
    def _gate_from_cumsum(G, cu_seqlens, chunk_size):
        """The per-token log decay back from FLA's chunk-local log2 cumsum."""
        g = G.double().clone()
        for spans in chunk_spans(G.shape[1], cu_seqlens, chunk_size):
            for s, e in spans:
                g[:, s + 1:e] = G[:, s + 1:e].double() - G[:, s:e - 1].double()
        return g * LN2

    def beta_sigmoid_fwd(self, x, scale=1.0):
        self._count("beta_sigmoid_fwd")
        return (scale * torch.sigmoid(x.double())).float()

    def beta_sigmoid_bwd(self, x, dy, scale=1.0):
        self._count("beta_sigmoid_bwd")
        s = torch.sigmoid(x.double())
        return (dy.double() * scale * s * (1 - s)).to(x.dtype)

    def prepare_chunk_indices(self, cu_seqlens, chunk_size):
        return ("chunk indices of", cu_seqlens, chunk_size)

    @staticmethod
    def _reference(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, use_gate_in_kernel, A_log, dt_bias,
                   lower_bound, chunk_size):
        return kda_reference(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                             A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=use_gate_in_kernel,
                             lower_bound=lower_bound, chunk_size=chunk_size)

    def chunk_kda_fwd(self, *, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                      chunk_indices, chunk_size, safe_gate, lower_bound, use_gate_in_kernel, A_log, dt_bias,
                      disable_recompute=False):
        self._count("chunk_kda_fwd")
        o, final = self._reference(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   cu_seqlens=cu_seqlens, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                                   dt_bias=dt_bias, lower_bound=lower_bound, chunk_size=chunk_size)
        B, T, HV = v.shape[:3]
        # whatever memory held
        noise = lambda: torch.randn(B, T, HV, chunk_size, dtype=k.dtype, device=k.device)  # noqa: E731
        t = torch.arange(T, device=k.device)
        if cu_seqlens is None:
            row = t % chunk_size
        else:
            seq = torch.searchsorted(cu_seqlens[1:], t, right=True).clamp(max=cu_seqlens.numel() - 2)
            row = (t - cu_seqlens[seq]) % chunk_size
        above = (torch.arange(chunk_size, device=k.device)[None, :] > row[:, None])[None, :, None, :]
        Akk = noise().masked_fill(above, 0)  # torch.zeros, then the lower triangle written
        g_cumsum = None if use_gate_in_kernel else local_cumsum(g, T, cu_seqlens, chunk_size, 1 / LN2)
        kept = [None] * 6
        if disable_recompute:  # FLA 0.6 keeps its intermediates (and the gate cumsum) for its backward
            K, V = k.shape[-1], v.shape[-1]
            like_k = lambda: torch.randn(B, T, HV, K, dtype=k.dtype, device=k.device)  # noqa: E731
            like_v = lambda: torch.randn(B, T, HV, V, dtype=v.dtype, device=v.device)  # noqa: E731
            chunks = -(-T // chunk_size)
            kept = [like_k(), like_v(), like_k(), like_k(), like_v(),
                    torch.randn(B, chunks, HV, K, V, dtype=k.dtype, device=k.device)]
            self.kept = kept
            if use_gate_in_kernel:
                g_cumsum = torch.randn(B, T, HV, K, dtype=torch.float32, device=k.device)
        return o, (final if output_final_state else None), g_cumsum, noise(), Akk, *kept, initial_state

    def chunk_kda_bwd(self, *, q, k, v, beta, Aqk, Akk, scale, initial_state, do, dht, g, g_org, cu_seqlens,
                      chunk_indices, chunk_size, safe_gate, lower_bound, use_gate_in_kernel, A_log, dt_bias,
                      disable_recompute=False, **intermediates):
        self._count("chunk_kda_bwd")
        # FLA 0.6 reads its kept intermediates from these keywords when disable_recompute is set
        self.received = [intermediates.get(n) for n in ("w", "u", "qg", "kg", "v_new", "h")] \
            if disable_recompute else None
        assert g is not None or not disable_recompute, "the kept gate cumsum must reach the backward"
        gate = g_org if use_gate_in_kernel else self._gate_from_cumsum(g, cu_seqlens, chunk_size)
        named = {"q": q, "k": k, "v": v, "beta": beta, "g": gate, "h0": initial_state, "A_log": A_log,
                 "dt_bias": dt_bias}
        leaves = {n: t.detach().double().requires_grad_() for n, t in named.items() if t is not None}
        with autograd_inside_op():  # the op's kernel runs below autograd
            o, final = self._reference(
                leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], scale=scale,
                initial_state=leaves.get("h0"), cu_seqlens=cu_seqlens, use_gate_in_kernel=use_gate_in_kernel,
                A_log=leaves.get("A_log"), dt_bias=leaves.get("dt_bias"), lower_bound=lower_bound,
                chunk_size=chunk_size)
            outputs, seeds = [o], [do.double()]
            if dht is not None:
                outputs.append(final)
                seeds.append(dht.double())
            grads = dict(zip(leaves, torch.autograd.grad(outputs, list(leaves.values()), seeds, allow_unused=True)))
        out = {n: (grads[n] if grads.get(n) is not None else torch.zeros_like(leaves[n])).to(named[n].dtype)
               for n in leaves}
        return (out["q"], out["k"], out["v"], out["beta"], out["g"], out.get("h0"), out.get("A_log"),
                out.get("dt_bias"))


@pytest.fixture
def fake_fla(monkeypatch):
    """The FLA backend on CPU, its kernels replaced by the stand-in."""
    fake = FakeFLA()
    monkeypatch.setattr(fla_backend, "_load_fla", lambda: (fake.namespace(), None))
    monkeypatch.setattr(fla_backend.FLABackend, "unsupported_reason", lambda self, *args: None)
    return fake


CASES = {
    "all-in-kernel-state": dict(shape=KDAShape(2, 70, 2, 4, 16, 8), gate_form="softplus", qk_l2norm=True,
                                beta_sigmoid=True, initial_state=True),
    "neg-eigval-lower-bound": dict(shape=KDAShape(1, 33, 2, 2, 8, 8), gate_form="lower_bound", A_log=False,
                                   lower_bound=-5.0, qk_l2norm=True, beta_sigmoid=True, allow_neg_eigval=True),
    "precomputed-gate-varlen": dict(shape=KDAShape(1, 40, 1, 2, 8, 16), cu_seqlens=[0, 0, 13, 40],
                                    initial_state=True),
}


@pytest.mark.parametrize("name", CASES)
def test_fla_path_matches_the_reference_forward_and_backward(fake_fla, name):
    options = dict(CASES[name])
    shape = options.pop("shape")
    args = make_kda_args(shape, device=DEVICE, seed=11, dtype=torch.float64, requires_grad=True,
                         output_final_state=True, **options)
    leaves = {n: t for n, t in args.items() if isinstance(t, torch.Tensor) and t.requires_grad}
    results = {}
    for path in ("fla", "reference"):
        with only_backends(*(("fla",) if path == "fla" else ())):
            o, final = chunk_kda(**args)
            seeds = [torch.ones_like(o), torch.full_like(final, 0.5)]
            results[path] = (o, final, torch.autograd.grad([o, final], list(leaves.values()), seeds))
    calls = fake_fla.calls
    assert calls.get("chunk_kda_fwd_intra") == 1 and calls.get("chunk_kda_bwd") == 1, calls  # FLA's kernels, ...
    assert "chunk_kda_fwd" not in calls, calls  # ... and our scan in place of FLA's last two
    (o, final, grads), (o_ref, final_ref, grads_ref) = results["fla"], results["reference"]
    assert_rel_close(o, o_ref, SCAN_TOL, name="o")
    assert_rel_close(final, final_ref, SCAN_TOL, name="final_state")
    for leaf, got, want in zip(leaves, grads, grads_ref):
        assert got.dtype == leaves[leaf].dtype and got.shape == leaves[leaf].shape, leaf
        assert_rel_close(got, want, TOL, name=f"d{leaf}")


def test_fla_path_residuals_match_their_fake_and_are_deterministic(fake_fla):
    """opcheck on the forward op: the residual shapes the fake promises (``residual_meta``) are the
    real ones, and two runs agree although FLA leaves the upper triangles of Aqk unwritten."""
    args = make_kda_args(KDAShape(2, 70, 2, 2, 16, 8), device=DEVICE, seed=5, gate_form="softplus", qk_l2norm=True,
                         beta_sigmoid=True, output_final_state=True, dtype=torch.float32)
    op_args = (args["q"], args["k"], args["v"], args["g"], args["beta"], args["A_log"], args["dt_bias"], None, None,
               float(args["scale"] or 16 ** -0.5), True, True, True, True, False, None, False, 64, True)
    with only_backends("fla"):
        torch.library.opcheck(torch.ops.kda_compile.chunk_kda_fwd.default, op_args)
        _, _, g_saved, Aqk, Akk, *_ = torch.ops.kda_compile.chunk_kda_fwd(*op_args)
    assert g_saved.numel() == 0  # the in-kernel gate: FLA's backward recomputes the cumsum from g
    above = (torch.arange(64)[None, :] > (torch.arange(70) % 64)[:, None])[None, :, None, :].to(DEVICE)
    assert Aqk.shape == Akk.shape == (2, 70, 2, 64)
    assert not Aqk.masked_select(above).any() and not Akk.masked_select(above).any()
    assert Aqk.masked_select(~above).all()  # the stand-in's noise below: nothing else was zeroed


def test_without_fla_the_backend_says_why(monkeypatch):
    monkeypatch.setattr(fla_backend, "_load_fla", lambda: (None, "fla-core is not importable (test)"))
    reason = fla_backend.FLABackend().unsupported_reason(torch.device("cuda"), torch.bfloat16, 64, 64,
                                                         types.SimpleNamespace(chunk_size=64))
    assert reason == "fla-core is not importable (test)"


@pytest.mark.parametrize("qk_l2norm", [True, False])
def test_fla_path_keeps_what_flas_autograd_keeps(fake_fla, qk_l2norm):
    """With the in-kernel L2 norm the op keeps the normalised q / k (and rstd) for the backward and lets
    the raw ones go, as FLA's own autograd function does: the activation memory of the FLA path is FLA's.
    Without the norm the raw q / k are what the backward reads, so they stay alive."""
    import weakref

    args = make_kda_args(KDAShape(1, 20, 2, 2, 8, 8), device=DEVICE, seed=3, gate_form="softplus", qk_l2norm=qk_l2norm,
                         dtype=torch.float64, requires_grad=True)
    q_leaf, k_leaf = args["q"], args["k"]
    args["q"], args["k"] = q_leaf * 1.0, k_leaf * 1.0  # non-leaf inputs: only the graph could keep them
    alive = [weakref.ref(args["q"]), weakref.ref(args["k"])]
    with only_backends("fla"):
        o, _ = chunk_kda(**args)
        del args["q"], args["k"]
        assert all((ref() is None) == qk_l2norm for ref in alive)
        o.sum().backward()
    assert q_leaf.grad is not None and k_leaf.grad is not None and torch.isfinite(q_leaf.grad).all()


def test_fla_path_residuals_hold_the_normalised_qk(fake_fla):
    args = make_kda_args(KDAShape(1, 20, 2, 2, 8, 8), device=DEVICE, seed=4, gate_form="softplus", qk_l2norm=True,
                         dtype=torch.float32)
    op_args = (args["q"], args["k"], args["v"], args["g"], args["beta"], args["A_log"], args["dt_bias"], None, None,
               8 ** -0.5, False, True, True, False, False, None, False, 64, True)
    with only_backends("fla"):
        _, _, _, _, _, qn, q_rstd, kn, k_rstd, *kept = torch.ops.kda_compile.chunk_kda_fwd(*op_args)
    assert all(t.numel() == 0 for t in kept)  # no intermediates kept unless asked
    for x, xn, rstd in ((args["q"], qn, q_rstd), (args["k"], kn, k_rstd)):
        want = (x.double().square().sum(-1) + 1e-6).rsqrt()
        assert_rel_close(rstd, want, 1e-6, name="rstd")
        assert_rel_close(xn, x.double() * want[..., None], 1e-6, name="normalised")


@pytest.mark.parametrize("name", CASES)
def test_disable_recompute_hands_flas_intermediates_to_its_backward(fake_fla, name):
    """``chunk_kda(disable_recompute=True)`` in training: the forward keeps FLA's intermediates (FLA's intra
    outputs, and the chunk states and ``v_new`` our scan writes), the op keeps them as residuals and FLA's
    backward gets exactly those tensors (not recomputed ones);
    the gradients are the default mode's. With ``cu_seqlens`` it is not honoured, and the report says why."""
    from kda_compile.ops._common import clear_fallback_events, fallback_events

    options = dict(CASES[name])
    shape = options.pop("shape")
    args = make_kda_args(shape, device=DEVICE, seed=12, dtype=torch.float64, requires_grad=True,
                         output_final_state=True, **options)
    leaves = {n: t for n, t in args.items() if isinstance(t, torch.Tensor) and t.requires_grad}
    varlen = args["cu_seqlens"] is not None
    grads = {}
    clear_fallback_events()
    with only_backends("fla"):
        for keep in (False, True):
            fake_fla.kept = fake_fla.received = None
            o, final = chunk_kda(**args, disable_recompute=keep)
            grads[keep] = torch.autograd.grad([o, final], list(leaves.values()),
                                              [torch.ones_like(o), torch.full_like(final, 0.5)])
            if keep and not varlen:  # w, u, qg, kg: FLA's intra outputs; v_new and h: our scan's
                received = fake_fla.received
                assert received is not None and all(
                    got.data_ptr() == want.data_ptr() and got.shape == want.shape
                    for got, want in zip(received[:4], fake_fla.kept)), "intermediates not handed on"
                w, u, _, kg = fake_fla.kept
                h_want, v_new_want, _ = states(w, u, kg, fake_fla.gate_cumsum, args["initial_state"], None, 64)
                assert_rel_close(received[4], v_new_want, SCAN_TOL, name="v_new")
                assert_rel_close(received[5], h_want, SCAN_TOL, name="h")
            else:
                assert fake_fla.received is None
    reasons = [event.reason for event in fallback_events() if event.op == "chunk_kda_backward"]
    assert any("disable_recompute" in r for r in reasons) == varlen, reasons
    for leaf, with_keep, without in zip(leaves, grads[True], grads[False]):
        assert_rel_close(with_keep, without, 1e-12, name=f"d{leaf}")


def test_calls_our_scan_does_not_take_run_flas_whole_forward_with_the_reason_recorded(fake_fla):
    """Chunk size 32 (or K / V above 256): FLA's own recurrence and output kernels, and the report says why."""
    from kda_compile.ops._common import clear_fallback_events, fallback_events
    from kda_compile.ops.kda.backends.registry import KDAOptions

    args = make_kda_args(KDAShape(1, 40, 1, 1, 8, 8), device=DEVICE, seed=6, dtype=torch.float64)
    opts = KDAOptions(scale=8 ** -0.5, chunk_size=32)
    assert fla_backend.our_scan_unsupported_reason(8, 8, opts) == "our scan kernel takes chunk_size 64, got 32"
    assert "K=264" in fla_backend.our_scan_unsupported_reason(264, 8, KDAOptions(scale=1.0))
    clear_fallback_events()
    o, _, _ = fla_backend.FLABackend().chunk_forward(
        args["q"], args["k"], args["v"], args["g"], args["beta"], None, None, None, None, opts,
        output_final_state=False, save=False)
    assert fake_fla.calls.get("chunk_kda_fwd") == 1 and "chunk_kda_fwd_intra" not in fake_fla.calls
    want, _ = kda_reference(args["q"], args["k"], args["v"], args["g"], args["beta"], scale=opts.scale, chunk_size=32)
    assert_rel_close(o, want, TOL, name="o")
    assert [(e.op, e.reason) for e in fallback_events()] == [("chunk_kda", "our scan kernel takes chunk_size 64, got 32")]
