"""Host time per call of each layer of the eager MLA decode path at batch 64 / cache 4k / 128 heads (session
15): the API, the custom op, the absorbed form, the kernel choice and the wgmma launcher. Where "host" equals
"wall", the call is host-bound (the GPU finishes first).

Run on the GPU box from the repository root: ``python kda_compile/bench/results/mla_decode_host_time.py``
(``mla_wgmma_session15_h100_2026-11-22.log``).
"""
import time
import torch
from kda_compile.bench import mla as M
from kda_compile.ops.mla import custom_ops as CO, wgmma_decode as W
from kda_compile.ops.mla.decode_kernels import mla_decode

layer = M._hf_layer(128)
query, kv, kr = M._decode_inputs(64, 4096, 128)
ours = M._providers(layer, compile_hf=False)["kda_compile"]
w = layer.kv_b_proj.weight
qn, qr = query[..., :128], query[..., 128:]
kin = M._kernel_inputs(layer, query, kv, kr)

def host(fn, n=300):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return 1e3 * (t1 - t0) / n, 1e3 * (t2 - t0) / n

cases = {
    "api (grad-enabled weight)": lambda: ours(query, kv, kr),
    "api under no_grad": lambda: ours(query, kv, kr),
    "torch.ops fwd, no_grad": lambda: torch.ops.kda_compile.mla_attention_fwd(qn, qr, kv[:, 0], kr[:, 0], w, None,
                                                                              layer.scaling, False, "auto"),
    "absorbed_mla_cuda": lambda: CO.absorbed_mla_cuda(qn, qr, kv[:, 0], kr[:, 0], w, None, layer.scaling, False),
    "mla_decode": lambda: mla_decode(*kin[:4], None, layer.scaling, False),
    "wgmma launcher": lambda: W.mla_decode_attention_wgmma(*kin[:4], None, layer.scaling, False),
    "resolve_path": lambda: CO.resolve_path("auto", qn, qr, kv[:, 0], w, False),
}
for name, fn in cases.items():
    if "no_grad" in name:
        with torch.no_grad():
            h, wall = host(fn)
    else:
        h, wall = host(fn)
    print(f"{name:28s} host {h:.3f} ms/call  wall {wall:.3f} ms/call", flush=True)
