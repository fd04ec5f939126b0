"""Experiment, not part of the package (run on the GPU box with OUT set): a persistent decode kernel
(programs loop over (head, V-block) work items, so Triton can pipeline the next state tile's load under
the current one's math) vs the current kernel, B = 64 / 256. Options fixed to the benchmark's (in-kernel
l2norm, softplus gate with A_log and dt_bias, beta sigmoid, initial and final state, contiguous)."""
import sys

import torch
import triton
import triton.language as tl

from kda_compile.ops import fused_recurrent_kda
from kda_compile.bench.common import cuda_graph_time, experiment_log, measure_copy_bandwidth

p = experiment_log("decode_var.log")


@triton.jit
def persistent_kernel(q, k, v, g, beta, A_log, dt_bias, h0, o, ht, NH, HV: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, GROUP: tl.constexpr, scale, BV: tl.constexpr, NV: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    o_k = tl.arange(0, K)
    for idx in range(pid, NH * NV, nprog):
        i_nh = (idx // NV).to(tl.int64)
        i_v = idx % NV
        i_hv = i_nh % HV
        i_n = i_nh // HV
        i_h = i_hv // GROUP
        o_v = i_v * BV + tl.arange(0, BV)
        b_h = tl.load(h0 + i_nh * K * V + o_k[:, None] * V + o_v[None, :], eviction_policy="evict_first")
        b_q = tl.load(q + (i_n * (HV // GROUP) + i_h) * K + o_k).to(tl.float32)
        b_k = tl.load(k + (i_n * (HV // GROUP) + i_h) * K + o_k).to(tl.float32)
        b_v = tl.load(v + i_nh * V + o_v).to(tl.float32)
        b_g = tl.load(g + i_nh * K + o_k).to(tl.float32)
        b_beta = tl.load(beta + i_nh).to(tl.float32)
        decay = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        x = b_g + tl.load(dt_bias + i_hv * K + o_k).to(tl.float32)
        e = tl.exp(tl.minimum(x, 20.0))
        soft = tl.where(x > 20.0, x, tl.where(x < -15.0, e, tl.log(1.0 + e)))
        b_g = -decay * soft
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=0) + 1e-6) * scale
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
        b_beta = tl.sigmoid(b_beta)
        b_h = b_h * tl.exp(b_g)[:, None]
        b_u = b_beta * (b_v - tl.sum(b_h * b_k[:, None], axis=0))
        b_h = b_h + b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_h * b_q[:, None], axis=0)
        tl.store(o + i_nh * V + o_v, b_o.to(o.dtype.element_ty))
        tl.store(ht + i_nh * K * V + o_k[:, None] * V + o_v[None, :], b_h, eviction_policy="evict_first")


def launch(step, A_log, dt_bias, BV, warps, stages, per_sm):
    q, k, v, g, beta, h0 = step["q"], step["k"], step["v"], step["g"], step["beta"], step["initial_state"]
    B, _, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = torch.empty_like(v)
    ht = torch.empty_like(h0)
    NV = V // BV
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = (min(B * HV * NV, sms * per_sm),)
    persistent_kernel[grid](q, k, v, g, beta, A_log, dt_bias, h0, o, ht, B * HV, HV, K, V, HV // H, K ** -0.5,
                            BV=BV, NV=NV, num_warps=warps, num_stages=stages)
    return o, ht


def main():
    H, K, V = 32, 128, 128
    copy = measure_copy_bandwidth()[1]
    p(f"copy bandwidth {copy:.3f} TB/s")
    for B in (64, 256):
        make = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        steps = [dict(q=make(B, 1, H, K), k=make(B, 1, H, K), v=make(B, 1, H, V), g=make(B, 1, H, K),
                      beta=make(B, 1, H), initial_state=torch.randn(B, H, K, V, device="cuda") * 0.1)
                 for _ in range(8)]
        A_log = torch.rand(H, device="cuda")
        dt_bias = torch.randn(H * K, device="cuda") * 0.1
        common = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
        state_bytes = 2 * B * H * K * V * 4

        def ours():
            with torch.inference_mode():
                for s in steps:
                    fused_recurrent_kda(**s, **common)
        t = cuda_graph_time(ours)[1] / len(steps)
        p(f"B={B} current kernel: {t * 1e3:.2f} us/step, {state_bytes / t / 1e9:.3f} TB/s = "
          f"{100 * state_bytes / t / 1e9 / copy:.1f}% of copy")
        with torch.inference_mode():
            o_ref, h_ref = fused_recurrent_kda(**steps[0], **common)
        for BV in (16, 32, 64):
            for warps in (2, 4, 8):
                if K * BV // (32 * warps) > 64 or K * BV // (32 * warps) < 8:
                    continue
                for stages in (1, 2, 3):
                    for per_sm in (2, 4, 8, 16):
                        try:
                            o, h = launch(steps[0], A_log, dt_bias, BV, warps, stages, per_sm)
                            err = max(((o.float() - o_ref.float()).norm() / o_ref.float().norm()).item(),
                                      ((h - h_ref).norm() / h_ref.norm()).item())

                            def var(BV=BV, warps=warps, stages=stages, per_sm=per_sm):
                                for s in steps:
                                    launch(s, A_log, dt_bias, BV, warps, stages, per_sm)
                            t = cuda_graph_time(var, rep_ms=60)[1] / len(steps)
                            p(f"B={B} persistent BV={BV} warps={warps} stages={stages} per_sm={per_sm}: "
                              f"{t * 1e3:.2f} us/step, {100 * state_bytes / t / 1e9 / copy:.1f}% of copy, "
                              f"err {err:.1e}")
                        except Exception as exc:  # noqa: BLE001
                            p(f"B={B} BV={BV} warps={warps} stages={stages} per_sm={per_sm}: {type(exc).__name__} "
                              f"{str(exc)[:200]}")


if __name__ == "__main__":
    main()
    sys.exit(0)
