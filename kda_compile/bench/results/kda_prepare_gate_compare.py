"""The prepare kernel of commit 40f6f58 against the working tree's, side by side (run on the GPU box; not part of
the package). Extract the old kernel first: `git show 40f6f58:ops/kda/triton_chunk_prepare.py > .exp/prepare_old.py`.
Same launch as kda_prepare_profile.py (bf16, K = V = 128, in-kernel L2 norm / softplus gate / beta sigmoid), three
fixed configurations, 5 interleaved do_bench rounds (median), benchmark and strong decays; prints the relative
difference of the new outputs (w, u, qg, kd, A_qk) from the old. Session-11 run: kda_prepare_gate_h100_2026-11-22.log."""
import importlib.util
import statistics
import sys

import torch
import triton
sys.path.insert(0, "kda_compile/bench/results")
from kda_prepare_profile import CONFIGS as PROFILE_CONFIGS, launch_arguments
from kda_compile.bench.common import rel_error
from kda_compile.ops.kda.triton_chunk_prepare import kda_prepare_kernel as new_kernel
spec = importlib.util.spec_from_file_location("prepare_old", ".exp/prepare_old.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
CONFIGS = [PROFILE_CONFIGS[i] for i in (0, 9, 8)]  # the autotuner's three: BKC/BWC 32/128, 32/64, 16/64 (2 stages)
print("device", torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
for B, T, H in [(8, 4096, 32), (1, 8192, 32), (1, 65536, 16)]:
    for strong in (False, True):
        grid, tensors, kwargs = launch_arguments(B, T, H, strong=strong)
        outs = {}
        for name, kern in (("old", old.kda_prepare_kernel), ("new", new_kernel)):
            kern[grid](*tensors, **kwargs, **CONFIGS[0]); torch.cuda.synchronize()
            outs[name] = [t.float().clone() for t in tensors[7:12]]
        errs = [rel_error(a, b) for a, b in zip(outs["new"], outs["old"])]
        for config in CONFIGS:
            times = {"old": [], "new": []}
            for _ in range(5):
                for name, kern in (("old", old.kda_prepare_kernel), ("new", new_kernel)):
                    times[name].append(triton.testing.do_bench(lambda: kern[grid](*tensors, **kwargs, **config), warmup=25, rep=100))
            o, n = statistics.median(times["old"]), statistics.median(times["new"])
            print(f"{B}x{T}x{H} strong={int(strong)} {config}: old {o:.3f} new {n:.3f} old/new {o / n:.3f}", flush=True)
        print("   new vs old rel err w,u,qg,kd,Aqk: " + " ".join(f"{e:.1e}" for e in errs), flush=True)
