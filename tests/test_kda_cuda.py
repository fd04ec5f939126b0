"""KDA on CUDA: our ops against FLA's own public functions (same kernels underneath, so outputs and
gradients must agree to rounding) and against the fp32 reference on CPU (kda.md section 7
tolerances). Skipped without CUDA; FLA comparisons skipped without fla-core."""
import contextlib
import importlib.util

import pytest
import torch

from kda_compile.ops import chunk_kda, fused_recurrent_kda
from kda_compile.ops._common import clear_fallback_events, fallback_events
from kda_compile.ops.kda.backends.registry import only_backends
from kda_compile.testing import assert_rel_close

pytestmark = pytest.mark.cuda
needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="fla-core not installed")

# (B, T, H, HV, K, V, varlen offsets or None)
CASES = [
    (2, 300, 2, 2, 128, 128, None),
    (1, 200, 2, 4, 64, 100, None),  # GVA, V not a power of two
    (1, 333, 4, 4, 60, 64, [0, 0, 100, 101, 333]),  # varlen with a zero-length sequence, K = 60
]
OPTIONS = [
    dict(),
    dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True),
    dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0,
         safe_gate=True),
]


def _inputs(B, T, H, HV, K, V, offsets, opts, seed=0):
    torch.manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    raw_gate = opts.get("use_gate_in_kernel", False)
    q = torch.randn(B, T, H, K, device=dev, dtype=dt)
    k = torch.randn(B, T, H, K, device=dev, dtype=dt)
    if not opts.get("use_qk_l2norm_in_kernel"):
        q, k = (torch.nn.functional.normalize(x.float(), dim=-1).to(dt) for x in (q, k))
    v = torch.randn(B, T, HV, V, device=dev, dtype=dt)
    g = torch.randn(B, T, HV, K, device=dev, dtype=dt) if raw_gate else (
        -torch.rand(B, T, HV, K, device=dev) * 0.3).to(dt)
    beta = torch.randn(B, T, HV, device=dev, dtype=dt) if opts.get("use_beta_sigmoid_in_kernel") else torch.rand(
        B, T, HV, device=dev, dtype=dt)
    N = B if offsets is None else len(offsets) - 1
    tensors = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=torch.randn(N, HV, K, V, device=dev) * 0.1)
    extra = dict(output_final_state=True, **opts)
    if offsets is not None:
        extra["cu_seqlens"] = torch.tensor(offsets, device=dev, dtype=torch.int32)
    if raw_gate:
        tensors["A_log"] = torch.rand(HV, device=dev)
        tensors["dt_bias"] = torch.randn(HV * K, device=dev) * 0.1
    return tensors, extra


def _run(fn, tensors, extra, do, dht):
    leaves = {n: t.detach().clone().requires_grad_() for n, t in tensors.items()}
    o, ht = fn(**leaves, **extra)
    ((o.float() * do).sum() + (ht * dht).sum()).backward()
    return o, ht, {n: t.grad for n, t in leaves.items()}


@needs_fla
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("opts", OPTIONS)
def test_chunk_kda_matches_fla(case, opts):
    tensors, extra = _inputs(*case, opts)
    _assert_matches_fla(tensors, extra)


def _assert_matches_fla(tensors, extra, path=("fla",), o_tol=1e-3, state_tol=1e-4, grad_tol=1e-3):
    """Our chunk_kda against FLA's with the same arguments: outputs, final state and gradients, with no
    fallback on our side; the relative errors by name. ``path``: the backends ours may use (by default its
    FLA path, FLA's kernels with our scan: bounded lower-bound gates would otherwise go to our own
    kernels; ``None``: the op's own choice)."""
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    do = torch.randn(*tensors["v"].shape, device="cuda")
    dht = torch.randn_like(tensors["initial_state"])
    clear_fallback_events()
    with only_backends(*path) if path else contextlib.nullcontext():
        o, ht, grads = _run(chunk_kda, tensors, extra, do, dht)
    o_ref, ht_ref, grads_ref = _run(fla_chunk_kda, tensors, extra, do, dht)
    assert not fallback_events(), f"expected no fallback, got {fallback_events()}"
    errors = {"o": assert_rel_close(o, o_ref, o_tol, name="o"),
              "final_state": assert_rel_close(ht, ht_ref, state_tol, name="final_state")}
    for name in grads_ref:
        errors[f"d{name}"] = assert_rel_close(grads[name], grads_ref[name], grad_tol, name=f"d{name}")
    return errors


@needs_fla
@pytest.mark.parametrize("case", CASES)
def test_bounded_gate_runs_our_kernels_within_bf16_rounding_of_fla(case):
    """The lower-bound gate with lower_bound = -5 (OPTIONS[2]) comes to our own prefill kernels by default
    (prefill_backend.preferred_reason): outputs and gradients against FLA's call, to bf16 rounding (our
    kernels keep other intermediates in bf16 than FLA's; both are held to FLA's tolerances of the fp64
    recurrence in tests/kda/test_triton_chunk.py)."""
    from kda_compile.ops.kda.backends.registry import KDAOptions, select_backend

    opts = OPTIONS[2]
    tensors, extra = _inputs(*case, opts)
    chosen = select_backend("chunk_kda", torch.device("cuda"), torch.bfloat16, case[4], case[5],
                            KDAOptions(scale=1.0, use_gate_in_kernel=True, lower_bound=opts["lower_bound"]))
    assert chosen.name == "triton_chunk"
    errors = _assert_matches_fla(tensors, extra, path=None, o_tol=1e-2, state_tol=1e-2, grad_tol=2e-2)
    print("relative errors against FLA:", " ".join(f"{n} {e:.1e}" for n, e in errors.items()))


@needs_fla
@pytest.mark.parametrize("case", [c for c in CASES if c[-1] is None])
@pytest.mark.parametrize("opts", OPTIONS)
def test_disable_recompute_matches_fla_and_keeps_the_intermediates(case, opts):
    """``disable_recompute=True`` is honoured as FLA honours it: the same outputs and gradients as FLA's call
    with the flag, and the forward leaves FLA's intermediates alive (w, u, qg, kg, v_new: five ``[B, T, HV, .]``
    tensors; h: one state per chunk) where the default leaves them to the backward to recompute."""
    tensors, extra = _inputs(*case, opts)
    keep = dict(extra, disable_recompute=True)
    _assert_matches_fla(tensors, keep)

    def kept_bytes(flags):
        leaves = {n: t.detach().clone().requires_grad_() for n, t in tensors.items()}
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = chunk_kda(**leaves, **flags)
        torch.cuda.synchronize()
        used = torch.cuda.memory_allocated() - before
        del out
        return used

    B, T, H, HV, K, V, _ = case
    chunks = -(-T // 64)
    intermediates = 2 * (B * T * HV * (3 * K + 2 * V) + B * chunks * HV * K * V)  # bf16
    assert kept_bytes(keep) - kept_bytes(extra) >= intermediates


@needs_fla
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_recurrent_matches_fla(batch):
    from fla.ops.kda import fused_recurrent_kda as fla_recurrent

    tensors, extra = _inputs(batch, 1, 4, 8, 128, 128, None, OPTIONS[1])
    with torch.inference_mode():
        o, ht = fused_recurrent_kda(**tensors, **extra)
        o_ref, ht_ref = fla_recurrent(**tensors, **extra)
    assert_rel_close(o, o_ref, 1e-3, name="o")
    assert_rel_close(ht, ht_ref, 1e-5, name="final_state")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("opts", OPTIONS[:2])
def test_cuda_matches_cpu_reference(case, opts):
    """Whatever serves CUDA (FLA or the reference) agrees with the fp32 CPU reference."""
    tensors, extra = _inputs(*case, opts)
    do = torch.randn(*tensors["v"].shape, device="cuda")
    dht = torch.randn_like(tensors["initial_state"])
    o, ht, grads = _run(chunk_kda, tensors, extra, do, dht)
    cpu = {n: t.cpu().float() if t.is_floating_point() and n != "initial_state" else t.cpu() for n, t in tensors.items()}
    extra_cpu = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in extra.items()}
    o_ref, ht_ref, grads_ref = _run(chunk_kda, cpu, extra_cpu, do.cpu(), dht.cpu())
    assert_rel_close(o, o_ref, 5e-3, name="o")
    assert_rel_close(ht, ht_ref, 5e-3, name="final_state")
    for name in ("q", "k", "v"):
        assert_rel_close(grads[name], grads_ref[name], 8e-3, name=f"d{name}")
    for name in ("g", "beta"):
        assert_rel_close(grads[name], grads_ref[name], 2e-2, name=f"d{name}")


def test_compiled_inductor_on_cuda_matches_eager():
    tensors, extra = _inputs(2, 130, 2, 2, 64, 64, None, OPTIONS[1])
    fn = torch.compile(lambda **kw: chunk_kda(**kw, **extra), fullgraph=True, dynamic=True)
    with torch.inference_mode():
        o, ht = fn(**tensors)
        o_ref, ht_ref = chunk_kda(**tensors, **extra)
    assert_rel_close(o, o_ref, 1e-6, name="o")
    assert_rel_close(ht, ht_ref, 1e-6, name="final_state")
