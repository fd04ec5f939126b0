"""Which formulation / launch config of our KDA scan kernel computes bf16 products right, and how fast
(the run behind kda_scan_bf16_configs_h100_2026-11-22.log; _scan_configs in ops/kda/triton_chunk.py).

Run from the repository root on a CUDA machine: python kda_compile/bench/results/kda_scan_bf16_configs.py
"""
import importlib.util, sys, torch, triton
sys.path.insert(0, ".")
src = open("ops/kda/triton_chunk_scan.py").read()
UPD = "        S = S * decay[:, None] + tl.dot(dot_operand(kd_t, DOT_BF16), v_op, input_precision=DOT_PRECISION)"
assert UPD in src
VARIANTS = {
    "as_is": src,
    "acc_form": src.replace(UPD, "        S = tl.dot(dot_operand(kd_t, DOT_BF16), v_op, S * decay[:, None], input_precision=DOT_PRECISION)"),
    "second_conversion": src.replace(UPD, "        S = S * decay[:, None] + tl.dot(dot_operand(kd_t, DOT_BF16), dot_operand(v_new + 0.0, DOT_BF16), input_precision=DOT_PRECISION)"),
    "trans_in_regs": src.replace(UPD, "        S = S * decay[:, None] + tl.dot(tl.trans(dot_operand(tl.trans(kd_t), DOT_BF16)), v_op, input_precision=DOT_PRECISION)"),
}
mods = {}
for name, text in VARIANTS.items():
    path = f"/tmp/scanvar_{name}.py"; open(path, "w").write(text)
    spec = importlib.util.spec_from_file_location(f"scanvar_{name}", path); m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m); mods[name] = m.kda_chunk_scan_kernel

def inputs(T, HV, K, V, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s, sc=1.0: (torch.randn(*s, device="cuda", generator=g) * sc).to(torch.bfloat16)
    w, qg, kd = r(T, HV, K, sc=0.1), r(T, HV, K, sc=0.1), r(T, HV, K, sc=0.1)
    u = r(T, HV, V)
    aqk = r(T, HV, 64, sc=0.1)
    rows = torch.arange(T, device="cuda") % 64
    aqk = torch.where(torch.arange(64, device="cuda")[None, None, :] <= rows[:, None, None], aqk, 0)
    decay = torch.rand(triton.cdiv(T, 64), HV, K, device="cuda", generator=g) * 0.1 + 0.9
    return w, u, qg, kd, aqk, decay

def reference(w, u, qg, kd, aqk, decay, T, HV, K, V):
    w, u, qg, kd, aqk, decay = (x.double() for x in (w, u, qg, kd, aqk, decay))
    S = torch.zeros(HV, K, V, dtype=torch.float64, device="cuda"); o = []
    for i, c0 in enumerate(range(0, T, 64)):
        sl = slice(c0, min(c0 + 64, T)); n = sl.stop - sl.start
        ww, uu, qq, kk, aa = (x[sl].transpose(0, 1) for x in (w, u, qg, kd, aqk))
        vn = uu - ww @ S
        o.append(qq @ S + aa[:, :, :n] @ vn)
        S = decay[i][:, :, None] * S + kk.transpose(1, 2) @ vn
    return torch.cat(o, 1).transpose(0, 1), S

def launch(kernel, args, T, HV, K, V, BV, warps, stages, dot_bf16, final):
    w, u, qg, kd, aqk, decay = args
    o = torch.empty(T, HV, V, dtype=torch.bfloat16, device="cuda")
    dummy = torch.empty(1, device="cuda"); e = torch.empty(0, dtype=torch.int32, device="cuda")
    BK = max(16, triton.next_power_of_2(K))
    kernel[(triton.cdiv(V, BV) * HV,)](w, u, qg, kd, aqk, decay, o, dummy, final, dummy, dummy, e, e, T, 1, 0, 0, 0, 0,
        HV=HV, K=K, V=V, BT=64, BK=BK, BV=BV, BKM=min(32, BK), IS_VARLEN=False, HAS_H0=False, STORE_HT=True,
        DOT_BF16=dot_bf16, DOT_PRECISION="tf32", COMBINE_PRECISION="tf32x3", num_warps=warps, num_stages=stages)
    return o

def correctness(name, warps, stages, dot_bf16):
    kernel = mods[name]
    for K, V, BV in [(64, 32, 32), (128, 32, 32), (128, 128, 64), (100, 128, 64), (100, 32, 32)]:
        T, HV = 256, 2
        args = inputs(T, HV, K, V)
        ro, rS = reference(*args, T, HV, K, V)
        final = torch.empty(1, HV, K, V, device="cuda")
        o = launch(kernel, args, T, HV, K, V, BV, warps, stages, dot_bf16, final); torch.cuda.synchronize()
        eo = ((o.double() - ro).norm() / ro.norm()).item(); es = ((final[0].double() - rS).norm() / rS.norm()).item()
        print(f"K={K} V={V} BV={BV} {name} w{warps}s{stages} bf16dot={dot_bf16}: o {eo:.1e} S {es:.1e}", flush=True)

if sys.argv[1:2] == ["--one"]:
    correctness(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"); sys.exit(0)
import subprocess
for name in mods:
    for warps, stages in ((8, 1), (8, 2), (4, 1)):
        for dot_bf16 in ((True, False) if name == "as_is" else (True,)):
            r = subprocess.run([sys.executable, __file__, "--one", name, str(warps), str(stages), str(int(dot_bf16))],
                               capture_output=True, text=True, timeout=120)
            print(r.stdout.strip(), flush=True)
            if r.returncode:
                print(f"  {name} w{warps}s{stages} bf16dot={dot_bf16} FAILED:", r.stderr.strip().splitlines()[-1][:200], flush=True)
# speed: T = 8192, HV = 32, K = V = 128 (BV = 64), correct variants only judged from the above
T, HV, K, V, BV = 8192, 32, 128, 128, 64
args = inputs(T, HV, K, V)
final = torch.empty(1, HV, K, V, device="cuda")
for name, kernel in mods.items():
    for warps, stages in ((8, 1), (8, 2), (4, 1)):
        for dot_bf16 in ((True, False) if name == "as_is" else (True,)):
            ms = triton.testing.do_bench(lambda: launch(kernel, args, T, HV, K, V, BV, warps, stages, dot_bf16, final), warmup=5, rep=30)
            print(f"speed T={T} HV={HV} K=V=128 {name} w{warps}s{stages} bf16dot={dot_bf16}: {ms:.3f} ms", flush=True)
