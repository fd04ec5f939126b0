"""Schedule variants of the session-14 wgmma MLA decode kernel: correctness (non-debug ones) and timing, side by side.

Record only: it ran against commit ab9dcd3; session 15 rewrote the kernel (TMA, three warpgroups) and removed
the SPLIT_S, LOADER_WG1 and DBG_NO_LOADS switches, so it no longer runs (``kernel_source`` rejects them).

Run on the GPU box from the repository root: ``python kda_compile/bench/results/mla_wgmma_variants.py``
(session 14, ``mla_wgmma_variants_h100_2026-11-22.log``). Each variant recompiles the kernel with
``wgmma_source.kernel_source(switches=...)``; the DBG_ switches drop a part of the work (the results are
then wrong) to show what that part costs. Percentages in the log are of the copy bandwidth this script
measures (a graph of 1 GiB copies: 2.44 TB/s there), not the benchmark's 3.0 TB/s.
"""
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kda_compile.ops.mla import wgmma_decode as W, wgmma_source as S  # noqa: E402
import mla_wgmma_check as C  # noqa: E402 - correctness and timing helpers

CUR = {}
W._source = lambda elem, c, m, p: S.kernel_source(elem=elem, is_causal=c, mask_kind=m, partial=p, switches=CUR)
VARIANTS = {
    "base": {}, "split_s": {"SPLIT_S": 1}, "loader_wg1": {"LOADER_WG1": 1}, "split_s+loader": {"SPLIT_S": 1, "LOADER_WG1": 1},
    "dbg_no_loads": {"DBG_NO_LOADS": 1}, "dbg_no_s": {"DBG_NO_S": 1}, "dbg_no_pv": {"DBG_NO_PV": 1},
    "dbg_no_softmax": {"DBG_NO_SOFTMAX": 1}, "split_s_no_loads": {"SPLIT_S": 1, "DBG_NO_LOADS": 1},
}
shapes = [(64, 4096, 128), (64, 4096, 64), (64, 16384, 128)]
data = {sh: C.make(sh[0], sh[2], 1, sh[1], torch.bfloat16) for sh in shapes}
for name, sw in VARIANTS.items():
    CUR.clear(); CUR.update(sw)
    if not name.startswith("dbg") and "no_loads" not in name:
        C.failures = 0
        C.case(f"[{name}] b2 h128 t1000 split3", 2, 128, 1, 1000, splits=3)
        C.case(f"[{name}] causal sq3 h40 split2", 2, 40, 3, 300, causal=True, splits=2)
        C.case(f"[{name}] bool mask dead rows", 3, 16, 4, 300, mask=C.dead_mask, splits=2)
        C.case(f"[{name}] additive mask", 3, 16, 4, 300, mask=C.add_mask)
    line = []
    for (B, T, H) in shapes:
        if (T == 16384) and name.startswith("dbg"):
            continue
        q_lat, q_rope, lat, rope = data[(B, T, H)]
        try:
            tw = C.graph_time(lambda: W.mla_decode_attention_wgmma(q_lat, q_rope, lat, rope, None, 0.1, False))
        except Exception:
            traceback.print_exc(); continue
        flops, nbytes = W.flops_and_bytes(B, H, 1, T)
        line.append(f"B{B}xT{T}xH{H} {tw*1e3:.1f} us ({100*nbytes/tw/1e9/C.copy_bw:.1f}% copy, {flops/tw/1e9:.0f} TF)")
    print(f"{name:18s} " + " | ".join(line), flush=True)
