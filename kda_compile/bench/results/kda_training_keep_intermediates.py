"""Side-by-side measurement of ``chunk_kda(disable_recompute=True)`` in training (run on the GPU box with OUT
set; not part of the package). Forward + backward of four providers on the benchmark's inputs (bf16,
K = V = 128, in-kernel L2 norm / softplus gate / beta sigmoid, fp32 initial state), timed in interleaved
rounds (each round times every provider once with ``triton.testing.do_bench``; the median over rounds is
reported, so a drift of the machine's speed affects all providers alike):

- FLA's ``chunk_kda`` with its default (the backward recomputes ``w, u, qg, kg, v_new, h``);
- FLA's ``chunk_kda(disable_recompute=True)`` (the forward keeps them);
- our op on FLA's kernels, default and with ``disable_recompute=True``.

Also the activation memory each forward leaves for its backward (bytes allocated after the forward, with
the output alive, minus before) and the gradients' relative error of each provider against FLA's default.

    python kda_training_keep_intermediates.py
"""
import os
import statistics
import time

import torch
import triton

from kda_compile.bench.common import experiment_log, rel_error

K = V = 128
ROUNDS = int(os.environ.get("ROUNDS", "5"))
SHAPES = [(1, 8192, 32), (8, 4096, 32), (1, 32768, 32), (8, 1024, 32), (1, 8192, 64), (16, 2048, 32)]
if os.environ.get("SHAPES"):  # e.g. SHAPES=1x8192x32,8x4096x32
    SHAPES = [tuple(int(n) for n in s.split("x")) for s in os.environ["SHAPES"].split(",")]
report = experiment_log("kda_training_keep_intermediates.log")


def providers():
    from fla.ops.kda import chunk_kda as fla_chunk

    from kda_compile.ops import chunk_kda
    from kda_compile.ops.kda.backends import only_backends

    def ours(**kwargs):
        with only_backends("fla"):  # the backward runs on the same backend (process-wide restriction)
            return chunk_kda(**kwargs)

    return {
        "FLA": (fla_chunk, False),
        "FLA disable_recompute": (fla_chunk, True),
        "ours (FLA path)": (ours, False),
        "ours (FLA path) disable_recompute": (ours, True),
    }


def inputs(B, T, H, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def leaf(*shape, dtype=torch.bfloat16, s=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * s).to(dtype).requires_grad_()

    return dict(q=leaf(B, T, H, K), k=leaf(B, T, H, K), v=leaf(B, T, H, V), g=leaf(B, T, H, K), beta=leaf(B, T, H),
                initial_state=leaf(B, H, K, V, dtype=torch.float32, s=0.1),
                A_log=torch.rand(H, device="cuda", generator=gen),
                dt_bias=torch.randn(H * K, device="cuda", generator=gen) * 0.1,
                scale=K ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def main() -> None:
    report(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    names = list(providers())
    for B, T, H in SHAPES:
        args = inputs(B, T, H, seed=B * T + H)
        leaves = [args[n] for n in ("q", "k", "v", "g", "beta", "initial_state")]
        do = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)
        runs, grads, kept = {}, {}, {}
        for name, (fn, keep) in providers().items():
            def run(fn=fn, keep=keep):
                o, _ = fn(**args, disable_recompute=keep)
                o.backward(do)

            for t in leaves:
                t.grad = None
            start = time.perf_counter()
            run()  # compiles and autotunes
            torch.cuda.synchronize()
            report(f"  {B}x{T}x{H} {name}: first call {time.perf_counter() - start:.1f} s")
            grads[name] = [t.grad.float().clone() for t in leaves]
            runs[name] = run
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            o, _ = fn(**args, disable_recompute=keep)
            torch.cuda.synchronize()
            kept[name] = (torch.cuda.memory_allocated() - before - o.numel() * o.element_size()) / 2 ** 20
            del o
        times = {name: [] for name in names}
        for _ in range(ROUNDS):
            for name in names:
                times[name].append(triton.testing.do_bench(runs[name], warmup=5, rep=150, grad_to_none=leaves))
        ms = {name: statistics.median(t) for name, t in times.items()}
        shape = f"{B}x{T}x{H}"
        for name in names:
            err = max(rel_error(got, want) for got, want in zip(grads[name], grads["FLA"]))
            report(f"{shape:12s} {name:36s} fwd+bwd {ms[name]:8.3f} ms  FLA/this {ms['FLA'] / ms[name]:6.3f}  "
                   f"kept for backward {kept[name]:8.1f} MiB  max grad rel err vs FLA {err:.1e}  "
                   f"rounds {' '.join(f'{t:.3f}' for t in times[name])}")


if __name__ == "__main__":
    main()
