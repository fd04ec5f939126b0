"""The CUDA prepare kernel against the Triton one, side by side (run on the GPU box; not part of the package).

1. Intermediates: both kernels on the same fresh random inputs (lower-bound gate -5, bf16, K = V = 128), over
   GVA, varlen, tails, L2 norm / beta sigmoid / A_log / dt_bias on and off, bf16 and fp32 gates, and the kept
   inverse; relative error of every output of the CUDA kernel against the Triton kernel's.
2. The whole forward (``chunk_kda_prefill``) with each prepare kernel against the fp64 recurrence.
3. Timing (``triton.testing.do_bench``, 5 interleaved rounds, median): the prepare kernels alone and the
   whole forward, at the benchmark's shapes.
Environment: ``SHAPES`` (``BxTxH,...``), ``SKIP_TIMING=1``.
"""
import os
import statistics

import torch
import triton

from kda_compile.bench.common import rel_error as _rel_error
from kda_compile.ops.kda import cuda_prepare
from kda_compile.ops.kda import triton_chunk as tc
from kda_compile.ops.kda.reference import kda_reference

K = V = 128
LB = -5.0


def rel_error(a, b) -> float:
    """||a - b|| / ||b||, or ||a - b|| when b is all zeros (decays that underflow)."""
    if b.float().norm().item() == 0.0:
        return (a.float() - b.float()).norm().item()
    return _rel_error(a, b)


def inputs(B, T, H, HV, *, offsets=None, g_dtype=torch.bfloat16, beta_dtype=torch.bfloat16, seed=0, shift=-4.0,
           raw=True):
    """Fresh inputs (``raw=False``: unit-norm q / k and beta in (0, 1), for calls without the in-kernel L2 norm
    and sigmoid); the raw gate is ``randn + shift`` (-4: about 0.2 nats a step, so 2^G stays well inside fp32
    over a chunk; 0: the benchmark's ~2.5 nats a step, where most of qg and decay underflow to 0)."""
    torch.manual_seed(seed)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q, k = torch.randn(B, T, H, K, **bf16), torch.randn(B, T, H, K, **bf16)
    v = torch.randn(B, T, HV, V, **bf16)
    g = (torch.randn(B, T, HV, K, device="cuda") + shift).to(g_dtype)
    beta = torch.randn(B, T, HV, device="cuda").to(beta_dtype)
    if not raw:
        q, k = (torch.nn.functional.normalize(x.float(), dim=-1).to(torch.bfloat16) for x in (q, k))
        beta = torch.sigmoid(beta.float()).to(beta_dtype)
    A_log = torch.rand(HV, device="cuda")
    dt_bias = torch.randn(HV * K, device="cuda") * 0.1
    cu = torch.tensor(offsets, device="cuda", dtype=torch.int32) if offsets is not None else None
    return q, k, v, g, beta, A_log, dt_bias, cu


def run(kernel, q, k, v, g, beta, A_log, dt_bias, cu, *, l2norm=True, sigmoid=True, use_a_log=True, use_dt=True,
        save=False, h0=None):
    os.environ[cuda_prepare.KERNEL_ENV] = kernel
    captured = {}
    original = tc.launch_scan

    def capture(w, u, qg, kd, a_qk, decay, *args, **kwargs):
        captured.update(w=w.clone(), u=u.clone(), qg=qg.clone(), kd=kd.clone(), a_qk=a_qk.clone(), decay=decay.clone())
        return original(w, u, qg, kd, a_qk, decay, *args, **kwargs)

    tc.launch_scan = capture
    try:
        o, final, res = tc.chunk_kda_prefill(
            q, k, v, g, beta, A_log if use_a_log else None, dt_bias if use_dt else None, h0, cu, scale=K ** -0.5,
            output_final_state=True, use_qk_l2norm_in_kernel=l2norm, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=sigmoid, lower_bound=LB, save_residuals=save)
    finally:
        tc.launch_scan = original
        os.environ.pop(cuda_prepare.KERNEL_ENV, None)
    torch.cuda.synchronize()
    captured.update(o=o, final=final)
    if save:
        captured.update(akk=res[2])
    return captured


def check(name, case, **flags):
    q, k, v, g, beta, A_log, dt_bias, cu = case
    a = run("cuda", *case, **flags)
    b = run("triton", *case, **flags)
    errs = {n: rel_error(a[n].float(), b[n].float()) for n in a if n not in ("decay",)}
    slots_used = b["decay"].shape[0]  # varlen allocates an upper bound of slots: compare the real chunks
    if cu is not None:
        slots_used = int(((cu[1:] - cu[:-1] + 63) // 64).sum())
    errs["decay"] = rel_error(a["decay"][:slots_used].float(), b["decay"][:slots_used].float())
    ref_o, ref_final = kda_reference(
        q.double(), k.double(), v.double(), g.double(), beta.double(), scale=K ** -0.5, cu_seqlens=cu,
        A_log=A_log.double() if flags.get("use_a_log", True) else None,
        dt_bias=dt_bias.double() if flags.get("use_dt", True) else None,
        use_qk_l2norm_in_kernel=flags.get("l2norm", True), use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=flags.get("sigmoid", True), lower_bound=LB)
    errs["o_vs_fp64(cuda)"] = rel_error(a["o"].double(), ref_o.double())
    errs["o_vs_fp64(triton)"] = rel_error(b["o"].double(), ref_o.double())
    errs["final_vs_fp64(cuda)"] = rel_error(a["final"].double(), ref_final.double())
    bad = any(e != e for e in errs.values())
    print(f"{name:34s}", " ".join(f"{n} {e:.2e}" for n, e in errs.items()), "NaN!" if bad else "", flush=True)
    return errs


def correctness():
    print("== intermediates: CUDA vs Triton prepare kernel; o vs fp64 ==", flush=True)
    worst = {}
    cases = [
        ("B2 T300 H2", inputs(2, 300, 2, 2), {}),
        ("B1 T256 H4 HV8 (GVA)", inputs(1, 256, 4, 8), {}),
        ("varlen [0,0,100,101,333]", inputs(1, 333, 4, 4, offsets=[0, 0, 100, 101, 333]), {}),
        ("B2 T130 no l2/sigmoid/alog/dt", inputs(2, 130, 2, 2, raw=False), dict(l2norm=False, sigmoid=False, use_a_log=False,
                                                                     use_dt=False)),
        ("B1 T200 fp32 gate+beta, save", inputs(1, 200, 2, 2, g_dtype=torch.float32, beta_dtype=torch.float32),
         dict(save=True)),
        ("B1 T64 save", inputs(1, 64, 2, 2), dict(save=True)),
        ("B1 T1", inputs(1, 1, 2, 2), {}),
        ("B2 T300 H2 benchmark decays", inputs(2, 300, 2, 2, shift=0.0), {}),
    ]
    for name, case, flags in cases:
        errs = check(name, case, **flags)
        for n, e in errs.items():
            worst[n] = max(worst.get(n, 0.0), e)
    print("worst:", " ".join(f"{n} {e:.2e}" for n, e in worst.items()), flush=True)


def timing():
    shapes = [tuple(int(x) for x in s.split("x")) for s in os.environ.get("SHAPES", "8x4096x32,1x8192x32").split(",")]
    print("== timing (ms, median of 5 interleaved do_bench rounds) ==", flush=True)
    for B, T, H in shapes:
        case = inputs(B, T, H, H, shift=0.0)  # the benchmark's gate input (randn)
        q, k, v, g, beta, A_log, dt_bias, cu = case

        def forward(kernel):
            os.environ[cuda_prepare.KERNEL_ENV] = kernel
            try:
                tc.chunk_kda_prefill(q, k, v, g, beta, A_log, dt_bias, None, None, scale=K ** -0.5,
                                     output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                     use_beta_sigmoid_in_kernel=True, lower_bound=LB)
            finally:
                os.environ.pop(cuda_prepare.KERNEL_ENV, None)

        # the prepare step alone: the forward with the scan replaced by nothing
        original = tc.launch_scan

        def prepare_only(kernel):
            tc.launch_scan = lambda *a, **kw: None
            try:
                forward(kernel)
            finally:
                tc.launch_scan = original

        results = {}
        for label, fn in (("prepare", prepare_only), ("forward", forward)):
            for kernel in ("triton", "cuda"):
                fn(kernel)
            torch.cuda.synchronize()
            for _ in range(5):
                for kernel in ("triton", "cuda"):
                    ms = triton.testing.do_bench(lambda: fn(kernel), warmup=25, rep=200)
                    results.setdefault((label, kernel), []).append(ms)
        line = f"{B}x{T}x{H}:"
        for label in ("prepare", "forward"):
            t, c = (statistics.median(results[(label, kk)]) for kk in ("triton", "cuda"))
            line += f"  {label}: triton {t:.3f} cuda {c:.3f} ({t / c:.2f}x)"
        print(line, flush=True)


def run_check(correctness, timing):
    """Print the device and versions, run ``correctness``, then ``timing`` unless ``SKIP_TIMING=1`` (shared with
    ``kda_scan_cuda_check.py``)."""
    print("device", torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    correctness()
    if os.environ.get("SKIP_TIMING") != "1":
        timing()


if __name__ == "__main__":
    run_check(correctness, timing)
