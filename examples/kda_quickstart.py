"""KDA with kda_compile: FLA's call, inside torch.compile(fullgraph=True), training and decode.

Runs on CPU (reference math) in a few seconds, or on CUDA (FLA kernels when fla-core is installed).
"""
import torch

import kda_compile
from kda_compile.ops import chunk_kda, fused_recurrent_kda

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
B, T, H, K, V = 2, 256, 4, 64, 64


def kda_layer(q, k, v, g, beta, A_log, dt_bias):
    """Raw projections in; the op applies L2 norm, the softplus gate and the beta sigmoid itself."""
    return chunk_kda(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
    )


def main():
    torch.manual_seed(0)
    make = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)  # noqa: E731
    q, k, v, g = make(B, T, H, K), make(B, T, H, K), make(B, T, H, V), make(B, T, H, K)
    beta = make(B, T, H)
    A_log = torch.zeros(H, device=device, requires_grad=True)
    dt_bias = torch.zeros(H * K, device=device, requires_grad=True)

    compiled = torch.compile(kda_layer, fullgraph=True, dynamic=True)
    o, state = compiled(q, k, v, g, beta, A_log, dt_bias)
    o.float().square().sum().backward()  # training: gradients flow to every input
    print(f"kda_compile {kda_compile.__version__} on {device}: o {tuple(o.shape)}, state {tuple(state.shape)}, "
          f"|dq| = {q.grad.float().norm():.3e}, |dA_log| = {A_log.grad.norm():.3e}")

    # Decode: one token at a time from the prefill state, same contract as FLA's fused_recurrent_kda.
    with torch.no_grad():
        step = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731
        o1, state = fused_recurrent_kda(
            step(B, 1, H, K), step(B, 1, H, K), step(B, 1, H, V), step(B, 1, H, K), step(B, 1, H), A_log, dt_bias,
            initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    print(f"decode step: o {tuple(o1.shape)}, finite: {bool(torch.isfinite(o1).all())}")


if __name__ == "__main__":
    main()
