"""Reference gated delta rule (GDN) math in plain torch: any device, differentiable, fp32 accumulation.

What the GDN ops run on CPU, what CUDA falls back to without fast kernels, and what the reference
backward differentiates (docs/gdn.md, section 1). Per value head ``h``, with state ``S`` ``[K, V]``::

    S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T (scale q_t)

``g_t`` is ONE log decay per (token, value head), so the chunked form below needs a ``[C, C]`` decay
matrix per head, where KDA's per-channel gate needs ``[C, C, K]`` (``kda_compile.ops.kda.reference``).
Decays between tokens are summed over their own span (never a difference of cumulative sums, which
cancels in fp32 and turns a ``-inf`` gate, an exact state reset, into NaN), as the KDA reference does.

``gdn_recurrence`` is the token-by-token loop of the definition above (no chunking, no WY form), in the
inputs' dtype: tests run it in fp64 as the ground truth.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kda_compile.ops.delta_rule.reference import compute_dtype, l2norm, reference_over_sequences


def gdn_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """GDN's log decay from the raw gate ``g`` ``[..., HV]``: ``-exp(A_log[h]) * softplus(g + dt_bias[h])``."""
    x = g if dt_bias is None else g + dt_bias.to(g.dtype)
    return -A_log.to(g.dtype).exp() * F.softplus(x)


def apply_input_options(q, k, g, beta, *, A_log, dt_bias, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                        use_beta_sigmoid_in_kernel, allow_neg_eigval):
    """The in-kernel options of FLA's contract, on inputs already in the compute dtype."""
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_gate_in_kernel:
        g = gdn_gate(g, A_log, dt_bias)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)
    return q, k, g, beta


def chunk_gdn_core(q, k, v, g, beta, scale: float, state: torch.Tensor, chunk_size: int = 64):
    """The chunked GDN recurrence on equal-length sequences, all inputs in one compute dtype.

    Args:
        q, k: ``[B, T, H, K]`` (normalised already if asked); v: ``[B, T, HV, V]``;
        g, beta: ``[B, T, HV]`` (finished log decays and betas); state: ``[B, HV, K, V]``.
    Returns:
        ``o [B, T, HV, V]`` and the final state ``[B, HV, K, V]``.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    C = chunk_size
    NC = (T + C - 1) // C
    pad = NC * C - T

    def to_chunks(x: torch.Tensor) -> torch.Tensor:
        # [B, T, heads, D] -> [B, HV, NC, C, D]; value head h reads q/k head h // (HV // H)
        if x.shape[2] != HV:
            x = x.repeat_interleave(HV // H, dim=2)
        x = F.pad(x, (0, 0, 0, 0, 0, pad))  # padded tokens: g = 0, beta = 0 leave the state as it is
        return x.view(B, NC, C, HV, x.shape[-1]).permute(0, 3, 1, 2, 4)

    qc, kc, vc = map(to_chunks, (q * scale, k, v))
    gc = to_chunks(g.unsqueeze(-1)).squeeze(-1)  # [B, HV, NC, C]
    bc = to_chunks(beta.unsqueeze(-1)).squeeze(-1)
    rows = torch.arange(C, device=q.device)
    causal = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    eye = torch.eye(C, device=q.device, dtype=q.dtype)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)

    outputs = []
    for n in range(NC):
        qn, kn, vn, gn, bn = qc[:, :, n], kc[:, :, n], vc[:, :, n], gc[:, :, n], bc[:, :, n]
        G = gn.cumsum(-1)  # [B, HV, C]: decay from the chunk start
        # exp(sum of g over (j, i]) for j <= i: column j sums only the gates after token j
        spans = torch.where(strict, gn[..., :, None], zero).cumsum(-2)
        decay = spans.masked_fill(~causal, float("-inf")).exp()  # [B, HV, C(i), C(j)]
        A_qk = (qn @ kn.transpose(-1, -2)) * decay
        A_kk = ((kn @ kn.transpose(-1, -2)) * decay * bn[..., :, None]).masked_fill(~strict, 0.0)
        rhs = bn[..., None] * torch.cat([G.exp()[..., None] * kn, vn], dim=-1)
        wu = torch.linalg.solve_triangular(eye + A_kk, rhs, upper=False, unitriangular=True)
        w, u = wu[..., :K], wu[..., K:]
        v_new = u - w @ state
        outputs.append(G.exp()[..., None] * (qn @ state) + A_qk @ v_new)
        to_last = decay[..., -1, :]  # exp(sum of g over (j, C - 1]) [B, HV, C(j)]
        state = G[..., -1:, None].exp() * state + (kn * to_last[..., None]).transpose(-1, -2) @ v_new

    if NC == 0:
        o = v.new_zeros(B, HV, 0, V)
    else:
        o = torch.stack(outputs, dim=2).reshape(B, HV, NC * C, V)[:, :, :T]
    return o.transpose(1, 2), state


def gdn_reference(q, k, v, g, beta, *, scale: float, initial_state=None, cu_seqlens=None, A_log=None,
                  dt_bias=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                  use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, chunk_size: int = 64):
    """Full GDN with FLA's semantics, chunked. Returns ``o`` in q's dtype and the final state
    ``[N, HV, K, V]`` in the compute dtype (fp32 for fp32/bf16/fp16 inputs)."""
    cdt = compute_dtype(q.dtype)
    qf, kf, vf, gf, bf = (x.to(cdt) for x in (q, k, v, g, beta))
    qf, kf, gf, bf = apply_input_options(
        qf, kf, gf, bf, A_log=None if A_log is None else A_log.to(cdt),
        dt_bias=None if dt_bias is None else dt_bias.to(cdt), use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval)
    return reference_over_sequences(chunk_gdn_core, (qf, kf, vf, gf, bf), q, v, initial_state, cu_seqlens, scale,
                                    chunk_size)


def gdn_recurrence(q, k, v, g, beta, *, scale: float | None = None, initial_state=None, cu_seqlens=None,
                   A_log=None, dt_bias=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                   use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False):
    """The GDN definition token by token, in the inputs' dtype (pass fp64 tensors for a ground truth).
    Same arguments and results as :func:`gdn_reference` (``scale`` defaults to ``K ** -0.5``)."""
    q, k, g, beta = apply_input_options(
        q, k, g, beta, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    heads = torch.arange(HV, device=q.device) // (HV // H)
    bounds = [(b, 0, T) for b in range(B)] if cu_seqlens is None else \
        [(0, s, e) for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
    o = torch.zeros_like(v)
    finals = []
    for n, (b, start, end) in enumerate(bounds):
        S = initial_state[n].to(v.dtype).clone() if initial_state is not None else v.new_zeros(HV, K, V)
        for t in range(start, end):
            qt, kt = q[b, t, heads], k[b, t, heads]  # [HV, K]
            S = g[b, t, :, None, None].exp() * S
            delta = beta[b, t, :, None] * (v[b, t] - torch.einsum("hkv,hk->hv", S, kt))
            S = S + kt[:, :, None] * delta[:, None, :]
            o[b, t] = torch.einsum("hkv,hk->hv", S, scale * qt)
        finals.append(S)
    return o, torch.stack(finals) if finals else v.new_zeros(0, HV, K, V)
