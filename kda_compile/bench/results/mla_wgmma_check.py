"""Device check of the wgmma MLA decode kernel: correctness against an fp32 torch reference (masks,
causal, splits, edge cache lengths), then CUDA-graph timing against the Triton kernel, side by side.

Run on the GPU box from the repository root: ``python kda_compile/bench/results/mla_wgmma_check.py``
(session 14; also imported by ``mla_wgmma_variants.py``). The benchmark proper is
``python -m kda_compile.bench mla``; the tests are ``tests/mla/test_wgmma_decode.py``.
"""
import math
import traceback

import torch
from kda_compile.ops.mla import wgmma_decode as W
from kda_compile.ops.mla.triton_decode import mla_decode_attention as triton_decode

torch.manual_seed(0)
dev = "cuda"
print(torch.__version__, torch.cuda.get_device_name(), flush=True)

def ref(q_lat, q_rope, lat, rope, mask, scale, causal):
    s = (torch.einsum("bhsr,btr->bhst", q_lat.float(), lat.float())
         + torch.einsum("bhsd,btd->bhst", q_rope.float(), rope.float())) * scale
    B, H, Sq, T = s.shape
    keep = torch.ones_like(s, dtype=torch.bool)
    if causal:
        i = torch.arange(Sq, device=s.device)[:, None]; t = torch.arange(T, device=s.device)[None]
        keep = keep & (t <= T - Sq + i)
    if mask is not None:
        if mask.dtype == torch.bool: keep = keep & mask
        else: s = s + mask.float()
    s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    o = torch.einsum("bhst,btr->bhsr", p, lat.float()) / torch.where(l > 0, l, torch.ones_like(l))
    lse = torch.where(l[..., 0] > 0, m[..., 0] + torch.log(torch.where(l > 0, l, torch.ones_like(l))[..., 0]), torch.full_like(m[..., 0], float("-inf")))
    return o, lse

def rel(a, b):
    a = a.float(); b = b.float()
    if torch.isnan(a).any(): return float("nan")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

def make(B, H, Sq, T, dtype, permuted=True):
    if permuted:  # as custom_ops builds it: [H, B*Sq, R] viewed [B, H, Sq, R]
        q_lat = torch.randn(H, B * Sq, 512, device=dev, dtype=dtype).view(H, B, Sq, 512).permute(1, 0, 2, 3)
    else:
        q_lat = torch.randn(B, H, Sq, 512, device=dev, dtype=dtype)
    q_rope = torch.randn(B, Sq, H, 64, device=dev, dtype=dtype).transpose(1, 2)
    kv = torch.randn(B, T, 576, device=dev, dtype=dtype)
    return q_lat, q_rope, kv[..., :512], kv[..., 512:]

failures = 0
def case(name, B, H, Sq, T, dtype=torch.bfloat16, causal=False, mask=None, splits=None, permuted=True):
    global failures
    try:
        q_lat, q_rope, lat, rope = make(B, H, Sq, T, dtype, permuted)
        m = mask(B, H, Sq, T) if mask else None
        scale = 1 / math.sqrt(192)
        why = W.unsupported_reason(q_lat, q_rope, lat, rope)
        if why: print(name, "UNSUPPORTED", why); failures += 1; return
        o, lse = W.mla_decode_attention_wgmma(q_lat, q_rope, lat, rope, m, scale, causal, num_splits=splits)
        torch.cuda.synchronize()
        ro, rl = ref(q_lat, q_rope, lat, rope, m, scale, causal)
        to, tl_ = triton_decode(q_lat, q_rope, lat, rope, m, scale, causal)
        finite = torch.isfinite(rl)
        e_o, e_l = rel(o, ro), rel(lse[finite], rl[finite])
        e_t = rel(to, ro)
        inf_ok = bool((torch.isinf(lse) == torch.isinf(rl)).all())
        ok = e_o < 1e-2 and e_l < 1e-3 and inf_ok and not math.isnan(e_o)
        failures += not ok
        print(f"{'OK ' if ok else 'BAD'} {name}: o rel {e_o:.2e} (triton {e_t:.2e}) lse rel {e_l:.2e} inf_match {inf_ok}", flush=True)
    except Exception:
        failures += 1
        print("ERROR", name); traceback.print_exc()

def pad_mask(B, H, Sq, T):
    m = torch.ones(B, 1, Sq, T, dtype=torch.bool, device=dev)
    for b in range(B): m[b, :, :, : (b * 37) % max(1, T // 2)] = False
    return m
def add_mask(B, H, Sq, T):
    m = torch.zeros(B, 1, Sq, T, dtype=torch.bfloat16, device=dev)
    m[0] = torch.finfo(torch.bfloat16).min  # batch 0 fully masked with a finite value
    if B > 1: m[1, :, :, : T // 3] = float("-inf")
    return m
def dead_mask(B, H, Sq, T):
    m = pad_mask(B, H, Sq, T); m[0] = False; return m

# ---- timing ----
def graph_time(fn, reps=30):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2): fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(8): fn()
    for _ in range(3): g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) / 8)
    ts.sort(); return ts[len(ts) // 2]

def copy_bandwidth():
    buf = torch.empty(1 << 30, dtype=torch.uint8, device=dev); dst = torch.empty_like(buf)
    ms = graph_time(lambda: dst.copy_(buf))
    return 2 * buf.numel() / ms / 1e9
copy_bw = copy_bandwidth()
print(f"copy bandwidth {copy_bw:.3f} TB/s", flush=True)

if __name__ == "__main__":
    case("b2 h128 t1000", 2, 128, 1, 1000)
    case("b2 h128 t1000 split1", 2, 128, 1, 1000, splits=1)
    case("b2 h128 t1000 split3", 2, 128, 1, 1000, splits=3)
    case("b3 h64 t4096 fp16", 3, 64, 1, 4096, dtype=torch.float16)
    case("b1 h128 t4096 contiguous q", 1, 128, 1, 4096, permuted=False)
    case("t1", 2, 64, 1, 1)
    case("t65", 2, 64, 1, 65)
    case("causal sq2 h32", 2, 32, 2, 200, causal=True)
    case("causal sq3 h40 split2", 2, 40, 3, 300, causal=True, splits=2)
    case("bool mask sq4 h16", 3, 16, 4, 300, mask=pad_mask)
    case("bool mask dead rows", 3, 16, 4, 300, mask=dead_mask, splits=2)
    case("additive mask finfo.min", 3, 16, 4, 300, mask=add_mask)
    case("additive mask split", 3, 16, 4, 300, mask=add_mask, splits=3)
    case("h128 sq2 causal", 2, 128, 2, 513, causal=True)
    print("FAILURES", failures, flush=True)
    for B, T, H in [(64, 4096, 32), (64, 4096, 64), (64, 4096, 128), (8, 4096, 128), (64, 16384, 128), (1, 4096, 128), (64, 1024, 128)]:
        q_lat, q_rope, lat, rope = make(B, H, 1, T, torch.bfloat16)
        scale = 0.1
        tw = graph_time(lambda: W.mla_decode_attention_wgmma(q_lat, q_rope, lat, rope, None, scale, False))
        tt = graph_time(lambda: triton_decode(q_lat, q_rope, lat, rope, None, scale, False))
        flops, nbytes = W.flops_and_bytes(B, H, 1, T)
        print(f"B{B} T{T} H{H}: wgmma {tw*1e3:.1f} us ({nbytes/tw/1e9:.2f} TB/s, {100*nbytes/tw/1e9/copy_bw:.1f}% copy, {flops/tw/1e9:.0f} TFLOPS) "
              f"triton {tt*1e3:.1f} us ({100*nbytes/tt/1e9/copy_bw:.1f}%) speedup {tt/tw:.2f}x", flush=True)
