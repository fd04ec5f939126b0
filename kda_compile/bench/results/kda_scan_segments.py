"""The scan's segment count on single long sequences: the whole forward at every P side by side (run on the GPU box;
not part of the package).

For each shape, ``chunk_kda_prefill`` (bf16, K = V = 128, in-kernel L2 norm / lower-bound gate (-5) / beta sigmoid,
the benchmark's inputs) with ``segments`` forced to each P of ``SEGMENTS`` and with the automatic choice
(``choose_segments``), in interleaved ``do_bench`` rounds (median ms); every P's output against P = 1's (relative
error, which only rounding moves). Then a per-kernel profile of the automatic choice.
Environment: ``SHAPES`` (``BxTxH,...``), ``SEGMENTS`` (``1,2,3``), ``ROUNDS``, ``NO_H0=1`` (no initial state).
"""
import os
import statistics

import torch
import triton

from kda_compile.bench.common import rel_error
from kda_compile.ops.kda import triton_chunk as tc

K = V = 128
LB = -5.0


def inputs(B, T, H, seed=0):
    torch.manual_seed(seed)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q, k = torch.randn(B, T, H, K, **bf16), torch.randn(B, T, H, K, **bf16)
    v, g = torch.randn(B, T, H, V, **bf16), torch.randn(B, T, H, K, **bf16)
    beta = torch.randn(B, T, H, **bf16)
    A_log, dt_bias = torch.rand(H, device="cuda"), torch.randn(H * K, device="cuda") * 0.1
    h0 = None if os.environ.get("NO_H0") == "1" else torch.randn(B, H, K, V, device="cuda") * 0.1
    return q, k, v, g, beta, A_log, dt_bias, h0


def forward(case, segments):
    q, k, v, g, beta, A_log, dt_bias, h0 = case
    return tc.chunk_kda_prefill(q, k, v, g, beta, A_log, dt_bias, h0, None, scale=K ** -0.5, output_final_state=True,
                                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                lower_bound=LB, segments=segments)


def main():
    print("device", torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
          "h0", os.environ.get("NO_H0") != "1", flush=True)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [tuple(int(x) for x in s.split("x")) for s in os.environ.get("SHAPES", "1x32768x32").split(",")]
    counts = [int(x) for x in os.environ.get("SEGMENTS", "1,2,3,4").split(",")]
    rounds = int(os.environ.get("ROUNDS", "5"))
    for B, T, H in shapes:
        case = inputs(B, T, H)
        auto = tc.scan_segments(case[0].device, B, H, 2, 4, tc.summary_x_blocks(K, V, 64, case[7] is not None), T,
                                False, None)
        plain = forward(case, 1)
        errs = {}
        for P in counts:
            o, final, _ = forward(case, P)
            errs[P] = (rel_error(o.float(), plain[0].float()), rel_error(final, plain[1]))
        torch.cuda.synchronize()
        times = {}
        for _ in range(rounds):
            for P in counts:
                times.setdefault(P, []).append(triton.testing.do_bench(lambda P=P: forward(case, P), warmup=25, rep=150))
        line = f"{B}x{T}x{H} (auto P={auto}, {sm} SMs):"
        for P in counts:
            line += f"  P={P} {statistics.median(times[P]):.3f} ms (o {errs[P][0]:.1e}, final {errs[P][1]:.1e})"
        print(line, flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                forward(case, None)
            torch.cuda.synchronize()
        per = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per.setdefault(e.name[:40], []).append(e.device_time_total / 1000)
        print("   auto, per kernel (ms, mean of 10):",
              ", ".join(f"{n} {sum(t) / len(t):.3f}" for n, t in per.items()), flush=True)


if __name__ == "__main__":
    main()
