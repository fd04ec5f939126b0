"""The CUDA scan kernel against the Triton one, side by side (run on the GPU box; not part of the package).

1. Correctness: the whole forward (``chunk_kda_prefill``, CUDA prepare kernel) with each scan kernel on the same
   fresh inputs (bf16, K = V = 128, lower-bound gate -5 with weak decays so the state carries across chunks):
   o and the final state against the fp64 recurrence and against each other, over GVA, packed sequences (empty
   ones included), tails, with and without an initial state (strided too) and a final state; bitwise repeatability.
2. Timing (``triton.testing.do_bench``, interleaved rounds, median ms): the whole forward with the CUDA scan, the
   Triton scan at its automatic segment count, and the scan alone (per-kernel profile).
Environment: ``SHAPES`` (``BxTxH,...``), ``ROUNDS``, ``SKIP_TIMING=1``, ``VARIANTS`` (CUDA kernel builds to time,
``STAGESxBLOCK_V,...``; default ``auto``: the
launcher's stages and block rule)..
"""
import os
import statistics

import torch
import triton

from kda_compile.ops.kda import cuda_scan
from kda_compile.ops.kda import triton_chunk as tc
from kda_compile.ops.kda.reference import kda_reference
from kda_prepare_cuda_check import K, LB, inputs, rel_error, run_check


def forward(kernel, case, *, h0=None, final=True):
    q, k, v, g, beta, A_log, dt_bias, cu = case
    os.environ[cuda_scan.KERNEL_ENV] = kernel
    try:
        return tc.chunk_kda_prefill(q, k, v, g, beta, A_log, dt_bias, h0, cu, scale=K ** -0.5,
                                    output_final_state=final, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                    use_beta_sigmoid_in_kernel=True, lower_bound=LB)
    finally:
        os.environ.pop(cuda_scan.KERNEL_ENV, None)


def check(name, case, *, h0_mode=None, final=True):
    q, k, v, g, beta, A_log, dt_bias, cu = case
    N = q.shape[0] if cu is None else cu.numel() - 1
    HV = v.shape[2]
    h0 = None
    if h0_mode == "contiguous":
        h0 = torch.randn(N, HV, K, K, device="cuda")
    elif h0_mode == "strided":
        h0 = torch.randn(N, K, HV, K, device="cuda").transpose(1, 2)  # [N, HV, K, V] view, non-contiguous
    a = forward("cuda", case, h0=h0, final=final)
    a2 = forward("cuda", case, h0=h0, final=final)
    b = forward("triton", case, h0=h0, final=final)
    torch.cuda.synchronize()
    ref_o, ref_final = kda_reference(
        q.double(), k.double(), v.double(), g.double(), beta.double(), scale=K ** -0.5, cu_seqlens=cu,
        initial_state=h0.double() if h0 is not None else None, A_log=A_log.double(), dt_bias=dt_bias.double(),
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=LB)
    errs = {"o_cuda": rel_error(a[0].double(), ref_o.double()), "o_triton": rel_error(b[0].double(), ref_o.double()),
            "o_cuda_vs_triton": rel_error(a[0].float(), b[0].float())}
    if final:
        errs.update(final_cuda=rel_error(a[1].double(), ref_final.double()),
                    final_triton=rel_error(b[1].double(), ref_final.double()))
    same = torch.equal(a[0], a2[0]) and (not final or torch.equal(a[1], a2[1]))
    bad = any(e != e for e in errs.values())
    print(f"{name:40s}", " ".join(f"{n} {e:.2e}" for n, e in errs.items()), "bitwise-repeatable" if same else
          "NOT REPEATABLE", "NaN!" if bad else "", flush=True)


def correctness():
    print("== forward with the CUDA / Triton scan vs the fp64 recurrence ==", flush=True)
    check("B2 T300 H2 h0", inputs(2, 300, 2, 2), h0_mode="contiguous")
    check("B2 T300 H2 no h0", inputs(2, 300, 2, 2))
    check("B1 T256 H4 HV8 (GVA) strided h0", inputs(1, 256, 4, 8), h0_mode="strided")
    check("varlen [0,0,100,101,333] h0", inputs(1, 333, 4, 4, offsets=[0, 0, 100, 101, 333]), h0_mode="contiguous")
    check("varlen [0,64,64,200] no final", inputs(1, 200, 2, 2, offsets=[0, 64, 64, 200]), final=False)
    check("B1 T1 h0", inputs(1, 1, 2, 2), h0_mode="contiguous")
    check("B1 T64 no h0", inputs(1, 64, 2, 2))
    check("B1 T2000 H2 h0 (31 chunks)", inputs(1, 2000, 2, 2), h0_mode="contiguous")
    check("B2 T300 H2 benchmark decays h0", inputs(2, 300, 2, 2, shift=0.0), h0_mode="contiguous")


def timing():
    shapes = [tuple(int(x) for x in s.split("x")) for s in os.environ.get("SHAPES", "1x32768x32,8x4096x32").split(",")]
    rounds = int(os.environ.get("ROUNDS", "5"))
    variants = [None if v == "auto" else tuple(int(x) for x in v.split("x"))
                for v in os.environ.get("VARIANTS", "auto").split(",")]
    stages, block_rule = cuda_scan.STAGES, tc.cuda_block_v
    print(f"== timing (ms, median of {rounds} interleaved do_bench rounds) ==", flush=True)
    for B, T, H in shapes:
        case = inputs(B, T, H, H, shift=0.0)  # the benchmark's gate input (randn)
        h0 = torch.randn(B, H, K, K, device="cuda") * 0.1

        def run(kernel, variant=None):
            cuda_scan.STAGES, tc.cuda_block_v = stages, block_rule
            if variant is not None:
                cuda_scan.STAGES, tc.cuda_block_v = variant[0], (lambda pairs, sms, bv=variant[1]: bv)
            try:
                return forward(kernel, case, h0=h0)
            finally:
                cuda_scan.STAGES, tc.cuda_block_v = stages, block_rule

        fns = {"triton": lambda: run("triton")}
        fns.update({f"cuda({'auto' if v is None else f'stages x block_v {v[0]}x{v[1]}'})": (lambda v=v: run("cuda", v))
                    for v in variants})
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        times = {}
        for _ in range(rounds):
            for name, fn in fns.items():
                times.setdefault(name, []).append(triton.testing.do_bench(fn, warmup=25, rep=150))
        per = {}
        for name, fn in fns.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fn()
                torch.cuda.synchronize()
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA and "prepare" not in e.name:
                    per.setdefault(name, {}).setdefault(e.name[:30], []).append(e.device_time_total / 1000)
        t = statistics.median(times["triton"])
        line = f"{B}x{T}x{H}: forward triton-scan {t:.3f}"
        for name in fns:
            if name != "triton":
                c = statistics.median(times[name])
                line += f" | {name} {c:.3f} ({t / c:.2f}x)"
        line += " || scan kernels: " + "; ".join(
            f"{name} [" + ", ".join(f"{n} {sum(v) / len(v):.3f}" for n, v in per[name].items()) + "]" for name in per)
        print(line, flush=True)


if __name__ == "__main__":
    run_check(correctness, timing)
