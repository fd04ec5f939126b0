"""Where the prepare kernel's time goes (run on the GPU box; not part of the package): the kernel alone
(``kda_prepare_kernel``, no autotuner) launched with fixed configurations on the benchmark's inputs (bf16,
K = V = 128, in-kernel L2 norm / softplus gate with A_log and dt_bias / beta sigmoid), timed with
``triton.testing.do_bench`` at 8 x 4096 x 32 and 1 x 8192 x 32. Environment knobs:

- ``CONFIGS=0,3``: which of ``CONFIGS`` to time (default all); ``TAG``: a label for the printed lines;
- ``STRONG=1``: strong decays (``A_log = log U(1, 16)`` as Mamba-style inits, raw gate ~ N(0, 1)): most
  16-token blocks then exceed ``DIAG_RANGE_LIMIT`` in some channel and take the exact-diagonal pass;
- ``NOSLOW=1``: lift ``DIAG_RANGE_LIMIT`` (no exact-diagonal pass; outputs wrong for strong decays; timing only);
- ``OVERRIDE='SOLVE_PRECISION="tf32";L2NORM=False'``: replace kernel arguments (``'GATE=2;lower_bound=-5.0'``:
  the lower-bound gate, compiled without the exact diagonal as the launcher does), or time the kernel with a
  piece of work left out (outputs not meaningful);
- ``PROF=1``: one launch per configuration at 8 x 4096 x 32, for ``ncu -k regex:kda_prepare``.

The session-9 runs are in ``kda_prepare_profile_h100_2026-11-22.log``.
"""
import os

import torch
import triton

from kda_compile.ops.kda.triton_chunk_prepare import exact_diagonal_needed, kda_prepare_kernel
from kda_compile.ops.kda.triton_common import GATE_SOFTPLUS

K = V = 128
CONFIGS = [dict(BKC=bkc, BWC=bwc, num_warps=warps, num_stages=stages) for bkc, bwc, warps, stages in
           [(32, 128, 4, 1), (32, 128, 8, 1), (64, 128, 8, 1), (128, 128, 8, 1), (32, 64, 8, 2), (64, 64, 8, 2),
            (64, 128, 4, 1), (16, 64, 8, 2), (16, 64, 4, 2), (32, 64, 4, 1)]]


def launch_arguments(B, T, H, strong: bool):
    """(grid, tensors, keyword arguments) of one prepare launch on fresh random inputs."""
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q, k, g = (torch.randn(B, T, H, K, **bf16) for _ in range(3))
    v, beta = torch.randn(B, T, H, V, **bf16), torch.randn(B, T, H, **bf16)
    A_log = torch.log(torch.empty(H, device="cuda").uniform_(1, 16)) if strong else torch.rand(H, device="cuda")
    dt_bias = torch.randn(H * K, device="cuda") * 0.1
    tokens, slots = B * T, B * triton.cdiv(T, 64)
    outputs = (q.new_empty(tokens, H, K), q.new_empty(tokens, H, V), q.new_empty(tokens, H, K),
               q.new_empty(tokens, H, K), q.new_empty(B, T, H, 64), q.new_empty(slots, H, K, dtype=torch.float32))
    unused, no_offsets = q.new_empty(1, dtype=torch.float32), q.new_empty(0, dtype=torch.int32)
    tensors = (q, k, v, g, beta, A_log, dt_bias, *outputs, unused, unused, no_offsets, no_offsets)
    kwargs = dict(T=T, N=B, scale=K ** -0.5, beta_scale=1.0, lower_bound=0.0, H=H, HV=H, K=K, V=V, SEARCH_STEPS=1,
                  IS_VARLEN=False, L2NORM=True, GATE=int(GATE_SOFTPLUS), HAS_A_LOG=True, HAS_DT_BIAS=True,
                  BETA_SIGMOID=True, SAVE_AKK=False, SAVE_G=False, DOT_BF16=True, A_PRECISION="tf32",
                  SOLVE_PRECISION="tf32x3")
    for item in filter(None, os.environ.get("OVERRIDE", "").split(";")):
        name, value = item.split("=", 1)
        kwargs[name] = eval(value)  # a literal from the command line
    kwargs.setdefault("EXACT_DIAGONAL", exact_diagonal_needed(kwargs["GATE"], kwargs["lower_bound"]))
    return (slots, H), tensors, kwargs


def main() -> None:
    if os.environ.get("NOSLOW") == "1":
        import triton.language as tl

        kda_prepare_kernel.fn.__globals__["DIAG_RANGE_LIMIT"] = tl.constexpr(1e30)  # read at compile time
    configs = CONFIGS
    if os.environ.get("CONFIGS"):
        configs = [CONFIGS[int(i)] for i in os.environ["CONFIGS"].split(",")]
    profile, tag = os.environ.get("PROF") == "1", os.environ.get("TAG", "")
    shapes = [(8, 4096, 32)] if profile else [(8, 4096, 32), (1, 8192, 32)]
    for B, T, H in shapes:
        grid, tensors, kwargs = launch_arguments(B, T, H, strong=os.environ.get("STRONG") == "1")
        for config in configs:
            def launch(config=config):
                kda_prepare_kernel[grid](*tensors, **kwargs, **config)

            launch()  # compiles
            torch.cuda.synchronize()
            if not profile:
                ms = triton.testing.do_bench(launch, warmup=50, rep=300)
                print(f"{tag} {B}x{T}x{H} {config}: {ms:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
