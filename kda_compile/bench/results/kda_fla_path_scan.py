"""Side-by-side measurement of the default CUDA path of ``chunk_kda`` after session 10: FLA's gate and
intra-chunk kernels, then our scan kernel (``triton_fla_scan.py``) in place of FLA's
``chunk_gated_delta_rule_fwd_h`` + ``chunk_gla_fwd_o_gk``. Run on the GPU box with OUT set; not part of the
package. Benchmark inputs (bf16, K = V = 128, in-kernel L2 norm / softplus gate / beta sigmoid, fp32 initial
state); two providers, FLA's public ``chunk_kda`` and our op on its default CUDA backend, timed in
interleaved rounds (each round times both once with ``triton.testing.do_bench``; the median over rounds
is reported, so a drift of the machine's speed affects both alike):

- inference forward (``torch.no_grad``) on every shape of ``python -m kda_compile.bench kda``;
- forward + backward on ``TRAIN_SHAPES`` (the backward is FLA's on both sides).

Also the relative error of our output (and, in training, of every gradient) against FLA's.

    SHAPES=... TRAIN_SHAPES=... ROUNDS=5 python kda_fla_path_scan.py
"""
import os
import statistics

import torch
import triton

from kda_compile.bench.common import experiment_log, rel_error

K = V = 128
ROUNDS = int(os.environ.get("ROUNDS", "5"))


def _shapes(name, default):
    return [tuple(int(n) for n in s.split("x")) for s in os.environ.get(name, default).split(",") if s]


SHAPES = _shapes("SHAPES", "1x8192x32,8x4096x32,1x32768x32,8x1024x32,1x8192x64,8x1024x64,1x8192x96,8x1024x96,"
                           "16x2048x32,1x65536x16")
TRAIN_SHAPES = _shapes("TRAIN_SHAPES", "1x8192x32,8x4096x32,8x1024x32")
report = experiment_log("kda_fla_path_scan.log")


def providers():
    from fla.ops.kda import chunk_kda as fla_chunk

    from kda_compile.ops import chunk_kda
    return {"FLA": fla_chunk, "ours (default CUDA path)": chunk_kda}


def inputs(B, T, H, seed, grad):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def leaf(*shape, dtype=torch.bfloat16, s=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * s).to(dtype).requires_grad_(grad)

    return dict(q=leaf(B, T, H, K), k=leaf(B, T, H, K), v=leaf(B, T, H, V), g=leaf(B, T, H, K), beta=leaf(B, T, H),
                initial_state=leaf(B, H, K, V, dtype=torch.float32, s=0.1),
                A_log=torch.rand(H, device="cuda", generator=gen),
                dt_bias=torch.randn(H * K, device="cuda", generator=gen) * 0.1, output_final_state=True,
                scale=K ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def interleaved(runs, leaves=None):
    times = {name: [] for name in runs}
    for _ in range(ROUNDS):
        for name, run in runs.items():
            times[name].append(triton.testing.do_bench(run, warmup=5, rep=100, grad_to_none=leaves))
    return {name: statistics.median(t) for name, t in times.items()}, times


def main() -> None:
    from kda_compile.ops.kda.backends import KDAOptions, select_backend

    report(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    backend = select_backend("chunk_kda", torch.device("cuda"), torch.bfloat16, K, V, KDAOptions(scale=K ** -0.5))
    report(f"ours runs on the {backend.name} backend")
    for mode, shapes in (("fwd", SHAPES), ("fwd+bwd", TRAIN_SHAPES)):
        for B, T, H in shapes:
            grad = mode == "fwd+bwd"
            args = inputs(B, T, H, seed=B * T + H, grad=grad)
            leaves = [args[n] for n in ("q", "k", "v", "g", "beta", "initial_state")]
            do = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)
            runs, outs = {}, {}
            for name, fn in providers().items():
                def run(fn=fn):
                    if grad:
                        o, _ = fn(**args)
                        o.backward(do)
                    else:
                        with torch.no_grad():
                            return fn(**args)

                for t in leaves:
                    t.grad = None
                result = run()
                outs[name] = [t.grad.float().clone() for t in leaves] if grad else [x.float() for x in result]
                runs[name] = run
            torch.cuda.synchronize()
            ms, times = interleaved(runs, leaves if grad else None)
            ours = "ours (default CUDA path)"
            err = max(rel_error(got, want) for got, want in zip(outs[ours], outs["FLA"]))
            what = "grads" if grad else "o, final state"
            report(f"{mode:8s} {B}x{T}x{H:<4d} FLA {ms['FLA']:8.3f} ms  ours {ms[ours]:8.3f} ms  "
                   f"FLA/ours {ms['FLA'] / ms[ours]:6.3f}  max rel err of {what} vs FLA {err:.1e}  rounds FLA "
                   f"{' '.join(f'{t:.3f}' for t in times['FLA'])} ours {' '.join(f'{t:.3f}' for t in times[ours])}")


if __name__ == "__main__":
    main()
