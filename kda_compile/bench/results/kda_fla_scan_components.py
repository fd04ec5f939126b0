"""Session 10 experiment (run on the GPU box; not part of the package): our scan kernel over FLA 0.6's chunk
intermediates (``scan_fla_intermediates``) against FLA's own last two forward kernels, and as FLA's backward
recompute of ``h`` / ``v_new``. Inputs already normalised (q, k) and activated (beta); gate in the kernel.
Per shape: FLA's whole ``chunk_kda_fwd`` vs gate cumsum + intra (asked for qg) + our scan, each of FLA's
kernels alone, the relative error of o / final state against FLA's; with TRAIN=1 also FLA's
``chunk_kda_bwd`` with its own recompute vs with our scan's states.

    SHAPES=8x4096x32,... TRAIN=0 REP=60 python kda_fla_scan_components.py
"""
import os
import torch, triton
from triton.testing import do_bench
import importlib
fwd_mod = importlib.import_module("fla.ops.kda.chunk_fwd")
bwd_mod = importlib.import_module("fla.ops.kda.chunk_bwd")
from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
from fla.ops.kda.gate import kda_gate_chunk_cumsum
from fla.ops.kda.wy_fast import recompute_w_u_fwd
from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
from fla.ops.utils.constant import RCP_LN2
from kda_compile.bench.common import rel_error as rel
from kda_compile.ops.kda.triton_fla_scan import scan_fla_intermediates
from kda_compile.ops.kda.triton_glue import l2norm_fwd

dev = "cuda"
SHAPES = [tuple(int(x) for x in s.split("x")) for s in os.environ.get(
    "SHAPES", "8x4096x32,1x8192x32,1x32768x32,8x1024x32,1x8192x64,8x1024x64,1x8192x96,8x1024x96,16x2048x32,1x65536x16").split(",")]
TRAIN = os.environ.get("TRAIN", "1") == "1"

def bench(fn):
    return do_bench(fn, warmup=10, rep=int(os.environ.get("REP", "100")))

print("device", torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
for B, T, H in SHAPES:
    K = V = 128
    torch.manual_seed(0)
    q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    k = torch.randn_like(q); v = torch.randn_like(q); graw = torch.randn_like(q)
    beta = torch.randn(B, T, H, device=dev, dtype=torch.bfloat16).sigmoid()
    A_log = torch.rand(H, device=dev); dt_bias = torch.randn(H * K, device=dev) * 0.1
    h0 = torch.randn(B, H, K, V, device=dev) * 0.1
    qn, _ = l2norm_fwd(q); kn, _ = l2norm_fwd(k)
    scale = K ** -0.5
    common = dict(scale=scale, initial_state=h0, output_final_state=True, use_gate_in_kernel=True, A_log=A_log,
                  dt_bias=dt_bias, chunk_size=64)

    def fla_fwd():
        return fwd_mod.chunk_kda_fwd(q=qn, k=kn, v=v, g=graw, beta=beta, **common)

    def gate():
        return kda_gate_chunk_cumsum(g=graw, A_log=A_log, dt_bias=dt_bias, scale=RCP_LN2, chunk_size=64)

    def intra(g, keep=False):
        return chunk_kda_fwd_intra(q=qn, k=kn, v=v, gk=g, beta=beta, scale=scale, chunk_size=64, disable_recompute=keep)

    def hybrid():
        g = gate()
        w, u, qg, kg, Aqk, Akk = intra(g, True)
        o, final, _, _ = scan_fla_intermediates(qg, w, u, kg, Aqk, g, h0, None, scale=scale, output_final_state=True)
        return o, final, g, Aqk, Akk

    ref = fla_fwd()
    o_h, f_h, g, Aqk, Akk = hybrid()
    err_o, err_f = rel(o_h, ref[0]), rel(f_h, ref[1])
    w, u, qg, kg, _, _ = intra(g, True)
    t_fla, t_hyb = bench(fla_fwd), bench(hybrid)
    t_gate, t_intra, t_intra_qg = bench(gate), bench(lambda: intra(g)), bench(lambda: intra(g, True))
    t_fwdh = bench(lambda: chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=g, initial_state=h0, output_final_state=True, chunk_size=64))
    hh, vn, _ = chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=g, initial_state=h0, output_final_state=True, chunk_size=64)
    t_fwdo = bench(lambda: chunk_gla_fwd_o_gk(q=qn, v=vn, g=g, A=Aqk, h=hh, scale=scale, chunk_size=64))
    t_scan = bench(lambda: scan_fla_intermediates(qg, w, u, kg, Aqk, g, h0, None, scale=scale, output_final_state=True))
    t_t1 = bench(fla_fwd)  # second reading of FLA, after the others
    print(f"FWD {B}x{T}x{H}: fla {t_fla:.3f} ({t_t1:.3f}) hybrid {t_hyb:.3f} ratio {t_fla / t_hyb:.3f} | gate {t_gate:.3f} "
          f"intra {t_intra:.3f} (+qg {t_intra_qg:.3f}) fwd_h {t_fwdh:.3f} fwd_o {t_fwdo:.3f} our_scan {t_scan:.3f} | err o {err_o:.2e} final {err_f:.2e}",
          flush=True)
    if not TRAIN or B * T * H > 8 * 4096 * 32:
        continue
    # backward recompute: FLA's (recompute_w_u + fwd_h) vs recompute_w_u + our scan writing h / v_new
    do = torch.randn_like(v); dht = torch.randn_like(h0)
    bargs = dict(q=qn, k=kn, v=v, beta=beta, Aqk=Aqk, Akk=Akk, scale=scale, initial_state=h0, do=do, dht=dht,
                 chunk_size=64, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)

    def fla_bwd():
        return bwd_mod.chunk_kda_bwd(g=None, g_org=graw, disable_recompute=False, **bargs)

    def our_recompute():
        g = gate()
        w, u, qg, kg = recompute_w_u_fwd(q=qn, k=kn, v=v, beta=beta, A=Akk, gk=g)
        _, _, h, v_new = scan_fla_intermediates(None, w, u, kg, Aqk, g, h0, None, scale=scale, output_final_state=False,
                                                store_o=False, store_states=True)
        return g, dict(w=w, u=u, qg=qg, kg=kg, v_new=v_new, h=h)

    def hyb_bwd():
        g, kw = our_recompute()
        return bwd_mod.chunk_kda_bwd(g=g, g_org=graw, disable_recompute=True, **bargs, **kw)

    def fla_recompute():
        g = gate()
        w, u, qg, kg = recompute_w_u_fwd(q=qn, k=kn, v=v, beta=beta, A=Akk, gk=g)
        return chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=g, initial_state=h0, output_final_state=False, chunk_size=64)

    r_f, r_h = fla_bwd(), hyb_bwd()
    names = ["dq", "dk", "dv", "db", "dg", "dh0", "dA", "dbias"]
    errs = " ".join(f"{n} {rel(a, b):.1e}" for n, a, b in zip(names, r_h, r_f) if a is not None and b is not None and a.numel())
    _, kw = our_recompute(); hf, vf, _ = fla_recompute()
    err_h = rel(kw["h"], hf); err_v = rel(kw["v_new"], vf)
    t_fb, t_hb = bench(fla_bwd), bench(hyb_bwd)
    t_fr, t_hr = bench(fla_recompute), bench(our_recompute)
    print(f"BWD {B}x{T}x{H}: fla {t_fb:.3f} hybrid {t_hb:.3f} ratio {t_fb / t_hb:.3f} | recompute fla {t_fr:.3f} ours {t_hr:.3f}"
          f" | err h {err_h:.1e} v_new {err_v:.1e} | {errs}", flush=True)
