"""Experiment behind the MLA decode kernel's variants at 32 / 64 / 128 heads (run on the GPU box with OUT set;
not part of the package): the production split kernel of ``ops/mla/triton_decode.py`` rewritten at run time
(the same source, so the comparison stays side by side with the kernel it was taken from) with three
switches, each timed from a CUDA graph at batch 64, cache 4096, bf16, one KV split, with the compiled
kernel's register, spill, shared-memory and instruction counts (warpgroup MMA or mma.sync):

- ``WS``: the KV loop as ``tl.range(..., warp_specialize=True)`` (Triton 3.6's automatic warp specialisation);
- ``EVEN``: no tail masks on the tiles (the cache length is a multiple of the tile);
- ``PRESCALE``: q multiplied by ``scale * log2(e)`` beforehand, so the scores feed ``exp2`` directly.

The TTGIR of the 128-head production configuration goes to ``$OUT/mla_h128.ttgir``.
"""
import os
import sys

import torch
import triton
import triton.language as tl

import kda_compile.ops.mla.triton_decode as production
from kda_compile.bench.common import cuda_graph_time, experiment_log, measure_copy_bandwidth
from kda_compile.ops.mla.triton_decode import default_config, mla_decode_attention

LOG2E = production.LOG2E
p = experiment_log("mla_var.log")


# (production text, variant text): applied in order; each must match exactly once.
REWRITES = [
    ("def mla_decode_split_kernel(", "def var_kernel("),
    ("IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, PARTIAL: tl.constexpr, PRECISION: tl.constexpr,",
     "IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, PARTIAL: tl.constexpr, PRECISION: tl.constexpr,\n"
     "    WS: tl.constexpr, EVEN: tl.constexpr, PRESCALE: tl.constexpr,"),
    ("for start in range(lo, hi, BLOCK_N):", "for start in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):"),
    ("""        c = tl.load(c_base + offs_n[:, None] * stride_ct + offs_r[None, :] * stride_cr,
                    mask=col_ok[:, None] & r_ok[None, :], other=0.0)
        kr = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                     mask=col_ok[:, None] & d_ok[None, :], other=0.0)""",
     """        if EVEN:
            c = tl.load(c_base + offs_n[:, None] * stride_ct + offs_r[None, :] * stride_cr)
            kr = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd)
        else:
            c = tl.load(c_base + offs_n[:, None] * stride_ct + offs_r[None, :] * stride_cr,
                        mask=col_ok[:, None] & r_ok[None, :], other=0.0)
            kr = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                         mask=col_ok[:, None] & d_ok[None, :], other=0.0)"""),
    ("""        s = s * scale
        keep""", """        if not PRESCALE:
            s = s * scale
        keep"""),
    ("""        s = tl.where(keep, s, float("-inf"))""", """        if not EVEN:
            s = tl.where(keep, s, float("-inf"))"""),
    ("""        alpha = tl.exp2((m_i - m_use) * LOG2E)
        p = tl.exp2((s - m_use[:, None]) * LOG2E)""", """        if PRESCALE:
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
        else:
            alpha = tl.exp2((m_i - m_use) * LOG2E)
            p = tl.exp2((s - m_use[:, None]) * LOG2E)"""),
]


def build_variant_kernel():
    import inspect
    import linecache

    text = inspect.getsource(production.mla_decode_split_kernel.fn)
    for old, new in REWRITES:
        if text.count(old) != 1:
            raise RuntimeError(f"the production kernel changed: {old[:60]!r} matches {text.count(old)} times")
        text = text.replace(old, new)
    filename = "<mla_decode_variant>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)  # Triton reads the source
    scope = {"triton": triton, "tl": tl, "LOG2E": LOG2E}
    exec(compile(text, filename, "exec"), scope)
    return scope["var_kernel"]


var_kernel = build_variant_kernel()


def launch(ql, qr, c, kr, scale, bm, bn, warps, stages, ws, even, prescale):
    """One launch of the variant over the whole cache (one KV split, so its output is final)."""
    b, h, sq, r = ql.shape
    t, dr = c.shape[1], qr.shape[3]
    o = torch.empty((h, b, sq, r), dtype=c.dtype, device=c.device).permute(1, 0, 2, 3)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=c.device)
    if prescale:
        ql = ql * (scale * 1.4426950408889634)
        qr = qr * (scale * 1.4426950408889634)
    tps = triton.cdiv(t, bn)  # every tile in the one split
    ob = o.unsqueeze(3)
    kern = var_kernel[(triton.cdiv(sq * h, bm), 1, b)](
        ql, qr, c, kr, c, ob, lse, lse, lse, *ql.stride(), *qr.stride(), *c.stride(), *kr.stride(), 0, 0, 0, 0,
        *ob.stride(), *lse.unsqueeze(3).stride(), h, sq, t, r, dr, tps, float(scale),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=r, BLOCK_DR=dr, IS_CAUSAL=False, MASK_KIND=0, PARTIAL=False,
        PRECISION="tf32", WS=ws, EVEN=even, PRESCALE=prescale, num_warps=warps, num_stages=stages)
    return o, lse, kern


def main():
    copy = measure_copy_bandwidth()[1]
    p(f"copy bandwidth {copy:.3f} TB/s")
    B, T, R, Dr = 64, 4096, 512, 64
    for H in (128, 64, 32):
        torch.manual_seed(0)
        ql = torch.randn(B, H, 1, R, device="cuda", dtype=torch.bfloat16)
        qr = torch.randn(B, H, 1, Dr, device="cuda", dtype=torch.bfloat16)
        c = torch.randn(B, T, R, device="cuda", dtype=torch.bfloat16)
        kr = torch.randn(B, T, Dr, device="cuda", dtype=torch.bfloat16)
        scale = (192) ** -0.5
        ref, _ = mla_decode_attention(ql, qr, c, kr, None, scale, False)
        nbytes = B * T * (R + Dr) * 2
        t = cuda_graph_time(lambda: mla_decode_attention(ql, qr, c, kr, None, scale, False), rep_ms=60)[1]
        p(f"H={H} production: {t*1e3:.1f} us {100*nbytes/t/1e9/copy:.1f}% cfg={default_config(H, 512, c.dtype)}")
        for bm, bn, warps, stages in ((64, 64, 8, 2), (64, 32, 8, 3), (64, 32, 8, 4), (64, 64, 8, 1), (32, 64, 4, 2),
                                      (32, 32, 4, 3)):
            if bm > H:
                continue
            for ws in (False, True):
                for even, prescale in ((False, False), (True, False), (True, True)):
                    tag = f"H={H} m{bm} n{bn} w{warps} s{stages} ws={ws} even={even} prescale={prescale}"
                    try:
                        o, lse, kern = launch(ql, qr, c, kr, scale, bm, bn, warps, stages, ws, even, prescale)
                        err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
                        def run(bm=bm, bn=bn, warps=warps, stages=stages, ws=ws, even=even, prescale=prescale):
                            return launch(ql, qr, c, kr, scale, bm, bn, warps, stages, ws, even, prescale)
                        t = cuda_graph_time(run, rep_ms=60)[1]
                        ttgir = kern.asm.get("ttgir", "")
                        ptx = kern.asm.get("ptx", "")
                        info = (f"wgdot={ttgir.count('warp_group_dot')} ws_ops={ttgir.count('warp_specialize')} "
                                f"wgmma={ptx.count('wgmma.mma_async')} mma.sync={ptx.count('mma.sync')} "
                                f"regs={getattr(kern, 'n_regs', '?')} spills={getattr(kern, 'n_spills', '?')} "
                                f"smem={getattr(kern, 'metadata', None) and kern.metadata.shared}")
                        p(f"{tag}: {t*1e3:.1f} us {100*nbytes/t/1e9/copy:.1f}% err {err:.1e} {info}")
                    except Exception as exc:
                        p(f"{tag}: {type(exc).__name__} {str(exc)[:300]}")
        if H == 128:
            try:
                _, _, kern = launch(ql, qr, c, kr, scale, 64, 64, 8, 2, False, True, True)
                open(os.path.join(os.environ.get("OUT", "/tmp"), "mla_h128.ttgir"), "w").write(kern.asm["ttgir"])
            except Exception as exc:
                p("ttgir dump failed", exc)


if __name__ == "__main__":
    main()
    sys.exit(0)
