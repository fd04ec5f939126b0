"""The wgmma MLA decode kernel's time against the KV split count at long caches (session 15): the plain wave
model split batch 64 / cache 16k / 128 heads 37 ways ("auto" below: the Triton kernel's model), twice as slow as
one split. ``wgmma_decode.QUERY_TILES`` / ``PARTIAL_TILES`` come from this sweep.

Run on the GPU box from the repository root: ``python kda_compile/bench/results/mla_wgmma_split_sweep.py``
(``mla_wgmma_session15_h100_2026-11-22.log``).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kda_compile.ops.mla import wgmma_decode as W  # noqa: E402
from kda_compile.ops.mla.triton_decode import choose_num_splits, sm_count  # noqa: E402
import mla_wgmma_check as C  # noqa: E402 - timing helpers

for (B, T, H) in [(64, 16384, 128), (64, 16384, 64), (64, 4096, 128), (8, 16384, 128), (64, 8192, 128)]:
    q_lat, q_rope, lat, rope = C.make(B, H, 1, T, torch.bfloat16)
    flops, nbytes = W.flops_and_bytes(B, H, 1, T)
    auto = choose_num_splits(B * ((H + 63) // 64), (T + 63) // 64, sm_count(0), 4)
    line = []
    for ns in (1, 2, 3, 4, 6, 8, 16):
        tw = C.graph_time(lambda: W.mla_decode_attention_wgmma(q_lat, q_rope, lat, rope, None, 0.1, False,
                                                               num_splits=ns))
        line.append(f"{ns}:{tw*1e3:.0f}us/{100*nbytes/tw/1e9/3.01:.0f}%")
    print(f"B{B} T{T} H{H} (auto {auto}): " + " ".join(line), flush=True)
