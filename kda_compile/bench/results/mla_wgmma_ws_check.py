"""Session 15's wgmma MLA decode kernel (TMA copies, one score warpgroup and two value warpgroups): correctness
on edge cases against an fp32 torch reference, then CUDA-graph timing against the Triton kernel, and the
debug switches that drop the score or value product (results then wrong) to show what each part costs.

Run on the GPU box from the repository root: ``python kda_compile/bench/results/mla_wgmma_ws_check.py``
(session 15, ``mla_wgmma_session15_h100_2026-11-22.log``). Percentages are of the benchmark's 3.01 TB/s copy;
times are per call, 8 calls per CUDA graph (no L2 flush between calls, no graph launch per call).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kda_compile.ops.mla import wgmma_decode as W, wgmma_source as S  # noqa: E402
from kda_compile.ops.mla.triton_decode import mla_decode_attention as triton_decode  # noqa: E402
import mla_wgmma_check as C  # noqa: E402 - correctness and timing helpers

C.failures = 0
C.case("b2 h128 t1000", 2, 128, 1, 1000)
C.case("b2 h128 t1000 split3", 2, 128, 1, 1000, splits=3)
C.case("b2 h128 t20000 split1", 2, 128, 1, 20000, splits=1)
C.case("b3 h64 t4096 fp16", 3, 64, 1, 4096, dtype=torch.float16)
C.case("b1 h128 t4096 contiguous q", 1, 128, 1, 4096, permuted=False)
C.case("b1 h128 t1", 1, 128, 1, 1)
C.case("t65", 2, 64, 1, 65)
C.case("t128 (two tiles)", 2, 64, 1, 128)
C.case("t129 split1", 2, 64, 1, 129, splits=1)
C.case("h128 t65 fp16", 2, 128, 1, 65, dtype=torch.float16)
C.case("causal sq3 h40 split2", 2, 40, 3, 300, causal=True, splits=2)
C.case("causal sq3 h128 split2", 2, 128, 3, 300, causal=True, splits=2)
C.case("bool mask sq4 h16", 3, 16, 4, 300, mask=C.pad_mask)
C.case("bool mask dead rows h64 sq2", 3, 64, 2, 300, mask=C.dead_mask, splits=2)
C.case("additive mask h128", 3, 128, 1, 300, mask=C.add_mask)
C.case("additive mask split h32 sq4", 3, 32, 4, 300, mask=C.add_mask, splits=3)
C.case("h128 sq2 causal", 2, 128, 2, 513, causal=True)
print("FAILURES", C.failures, flush=True)

CUR = {}
W._source = lambda elem, c, m, p: S.kernel_source(elem=elem, is_causal=c, mask_kind=m, partial=p, switches=CUR)
shapes = [(64, 4096, 128), (64, 4096, 64), (64, 4096, 32), (64, 16384, 128), (64, 1024, 128), (8, 4096, 128),
          (1, 16384, 128), (32, 4096, 128)]
for name, sw in {"ws": {}, "no_s": {"DBG_NO_S": 1}, "no_pv": {"DBG_NO_PV": 1},
                 "no_s_no_pv": {"DBG_NO_S": 1, "DBG_NO_PV": 1}}.items():
    CUR.clear(); CUR.update(sw)
    for (B, T, H) in (shapes if name == "ws" else shapes[:2]):
        q_lat, q_rope, lat, rope = C.make(B, H, 1, T, torch.bfloat16)
        flops, nbytes = W.flops_and_bytes(B, H, 1, T)
        tw = C.graph_time(lambda: W.mla_decode_attention_wgmma(q_lat, q_rope, lat, rope, None, 0.1, False))
        tt = float("nan")
        if name == "ws":
            tt = C.graph_time(lambda: triton_decode(q_lat, q_rope, lat, rope, None, 0.1, False))
        print(f"{name:10s} B{B} T{T} H{H}: {tw*1e3:.1f} us ({100*nbytes/tw/1e9/3.01:.1f}% of 3.01 TB/s, "
              f"{flops/tw/1e9:.0f} TF) triton {tt*1e3:.1f} us -> {tt/tw:.2f}x", flush=True)
