"""Side-by-side measurement behind the decode kernel's load order (run on the GPU box with OUT set; not part
of the package): the decode kernel as of commit 686950c, whose token loads sat between the prologue's
L2-norm reductions (``git show 686950c:ops/kda/triton_decode.py > old.py``; pass its path), against the
current one, which issues them together. Same inputs, per step of 8 distinct steps in one CUDA graph, as a
fraction of the measured copy bandwidth; the benchmark's options (in-kernel L2 norm, softplus gate with
A_log and dt_bias, beta sigmoid, initial and final state), bf16, H = 32, K = V = 128.

    python kda_decode_load_order.py old.py
"""
import importlib.util
import sys

import torch

from kda_compile.bench.common import cuda_graph_time, experiment_log, measure_copy_bandwidth, rel_error
from kda_compile.ops.kda import triton_decode

STEPS = 8
report = experiment_log("kda_decode_load_order.log")


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("triton_decode_686950c", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(old_path: str) -> None:
    old = load_module(old_path)
    H, K, V = 32, 128, 128
    copy = measure_copy_bandwidth()[1]
    report(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth {copy:.3f} TB/s")
    options = dict(scale=K ** -0.5, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                   use_beta_sigmoid_in_kernel=True)
    for B in (1, 16, 64, 128, 256):
        gen = torch.Generator(device="cuda").manual_seed(B)

        def rand(*shape, dtype=torch.bfloat16, s=1.0):
            return (torch.randn(*shape, device="cuda", generator=gen) * s).to(dtype)

        steps = [(rand(B, 1, H, K), rand(B, 1, H, K), rand(B, 1, H, V), rand(B, 1, H, K), rand(B, 1, H),
                  rand(B, H, K, V, dtype=torch.float32, s=0.1)) for _ in range(STEPS)]
        A_log, dt_bias = rand(H, dtype=torch.float32), rand(H * K, dtype=torch.float32, s=0.1)
        kernels = {"686950c": old.fused_recurrent_kda_triton, "current": triton_decode.fused_recurrent_kda_triton}
        results, times = {}, {}
        for name, launch in kernels.items():
            def run(step, launch=launch):
                q, k, v, g, beta, h0 = step
                return launch(q, k, v, g, beta, A_log, dt_bias, h0, None, **options)
            results[name] = run(steps[0])
            times[name] = cuda_graph_time(lambda run=run: [run(s) for s in steps])[1] / STEPS
        state_bytes = 2 * B * H * K * V * 4
        pct = {n: 100 * state_bytes / (t * 1e-3) / 1e12 / copy for n, t in times.items()}
        (o_old, s_old), (o_new, s_new) = results["686950c"], results["current"]
        report(f"B={B:4d}: 686950c {times['686950c'] * 1e3:7.2f} us ({pct['686950c']:.1f}% of copy), current "
               f"{times['current'] * 1e3:7.2f} us ({pct['current']:.1f}%), speedup "
               f"{times['686950c'] / times['current']:.3f}x; rel. difference o {rel_error(o_new, o_old):.1e} "
               f"state {rel_error(s_new, s_old):.1e}")
    report(f"configs 686950c: {old._TUNED}")
    report(f"configs current: {triton_decode._TUNED}")


if __name__ == "__main__":
    main(sys.argv[1])
    sys.exit(0)
