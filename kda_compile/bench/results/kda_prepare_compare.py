"""An older prepare kernel against the working tree's, side by side (run on the GPU box; not part of the package).

Extract the old kernel first, e.g. `git show 57e3111:ops/kda/triton_chunk_prepare.py > .exp/prepare_old.py`
(``OLD``: another path; ``NEW``: a module file to time instead of the working tree's kernel).
Same launch as kda_prepare_profile.py (bf16, K = V = 128, in-kernel L2 norm / softplus gate / beta sigmoid).
``CONFIGS``: launch configurations ``BKC/BWC/warps/stages[/maxnreg]`` separated by ``;`` (default: the
autotuner's three). Per configuration: 5 interleaved do_bench rounds (median) of both kernels, on the benchmark's
decays and on strong ones, and the relative difference of the new outputs (w, u, qg, kd, A_qk) from the old
kernel's in the first configuration. Runs: kda_prepare_gate_h100_2026-11-22.log (session 11, commit 40f6f58
against the cheaper softplus), kda_prepare_layout_h100_2026-11-22_session12.log (session 12)."""
import importlib.util
import os
import statistics
import sys

import torch
import triton
sys.path.insert(0, "kda_compile/bench/results")
from kda_prepare_profile import launch_arguments
from kda_compile.bench.common import rel_error
from kda_compile.ops.kda.triton_chunk_prepare import kda_prepare_kernel as new_kernel

DEFAULT_CONFIGS = "32/128/4/1;32/64/4/1;16/64/4/2"


def parse_config(text: str) -> dict:
    """``BKC/BWC/warps/stages[/maxnreg]`` as launch keywords."""
    fields = [int(x) for x in text.split("/")]
    config = dict(BKC=fields[0], BWC=fields[1], num_warps=fields[2], num_stages=fields[3])
    if len(fields) > 4:
        config["maxnreg"] = fields[4]
    return config


def load_kernel(name: str, path: str):
    """``kda_prepare_kernel`` of the module file at ``path``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kda_prepare_kernel


def main() -> None:
    kernels = (("old", load_kernel("prepare_old", os.environ.get("OLD", ".exp/prepare_old.py"))),
               ("new", load_kernel("prepare_new", os.environ["NEW"]) if os.environ.get("NEW") else new_kernel))
    configs = [parse_config(c) for c in os.environ.get("CONFIGS", DEFAULT_CONFIGS).split(";")]
    shapes = [tuple(int(x) for x in s.split("x")) for s in os.environ.get("SHAPES", "8x4096x32,1x8192x32").split(",")]
    print("device", torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    for B, T, H in shapes:
        for strong in (False, True):
            grid, tensors, kwargs = launch_arguments(B, T, H, strong=strong)
            # each kernel's own arguments (an older kernel takes fewer)
            own = {name: {k: v for k, v in kwargs.items() if k in kern.arg_names} for name, kern in kernels}
            reference = None
            for config in configs:
                outs = {}
                for name, kern in kernels:
                    kern[grid](*tensors, **own[name], **config)
                    torch.cuda.synchronize()
                    outs[name] = [t.float().clone() for t in tensors[7:12]]
                reference = reference or outs["old"]
                errs = [rel_error(a, b) for a, b in zip(outs["new"], reference)]
                times = {"old": [], "new": []}
                for _ in range(5):
                    for name, kern in kernels:
                        times[name].append(triton.testing.do_bench(
                            lambda: kern[grid](*tensors, **own[name], **config), warmup=25, rep=100))
                o, n = statistics.median(times["old"]), statistics.median(times["new"])
                print(f"{B}x{T}x{H} strong={int(strong)} {config}: old {o:.3f} new {n:.3f} old/new {o / n:.3f}"
                      f"   new vs old (first config) rel err w,u,qg,kd,Aqk: " + " ".join(f"{e:.1e}" for e in errs),
                      flush=True)


if __name__ == "__main__":
    main()
