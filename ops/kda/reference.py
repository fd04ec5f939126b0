"""Reference KDA math in plain torch: runs on any device, differentiable, fp32 accumulation.

This is what the ops run on CPU, what CUDA falls back to without fast kernels, and what the
reference backward differentiates. It follows docs/kda.md:

- the in-kernel options (section 2): L2 norm with the eps inside the sqrt, the softplus and the
  lower-bound gate, the beta sigmoid;
- the chunked WY algorithm (section 4), vectorised over batch, heads and the rows of a chunk, with a
  Python loop over chunks only (the inter-chunk state scan is sequential);
- packed variable-length sequences (``cu_seqlens``) by padding to ``[N, T_max]``: a padded token has
  gate 0 and beta 0, which leaves the state untouched, so final states stay exact.

Decays between tokens, ``exp(sum of g over (j, i])``, are summed from the gates of that span only
(``_span_decays``), never as a difference ``G_i - G_j`` of cumulative sums: that difference cancels
(after a gate of -1e4 both sums are about -1e4 and fp32 keeps ~1e-3 of the difference) and turns a
``-inf`` gate (an exact reset of the state) into ``-inf - (-inf) = NaN``. Spans with ``j > i`` are masked
to ``-inf`` before ``exp`` (their sum is positive and would overflow). Exponentials of the cumulative sum
from the chunk start (``exp(G_i)``, which may be ``exp(-inf) = 0``) lose nothing that matters: their
absolute error ``exp(G) |G| eps`` is at most ``eps / e``.

Packed sequences are read to the host once (``cu_seqlens.tolist()``, as the padding needs the longest
length) and their offsets checked there, for free: a call on this path never computes on bad offsets.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kda_compile.ops.delta_rule.reference import compute_dtype, l2norm, reference_over_sequences


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
) -> torch.Tensor:
    """Log-space decay from the raw gate projection ``f`` ``[..., HV, K]``.

    softplus form: ``-exp(A_log[h]) * softplus(f + dt_bias[h])``;
    lower-bound form (``lower_bound`` given): ``lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias[h]))``,
    with ``A_log`` optional.
    """
    HV, K = f.shape[-2:]
    x = f
    if dt_bias is not None:
        x = x + dt_bias.view(HV, K).to(f.dtype)
    if lower_bound is None:
        return -A_log.view(HV, 1).to(f.dtype).exp() * F.softplus(x)
    if A_log is not None:
        x = A_log.view(HV, 1).to(f.dtype).exp() * x
    return lower_bound * torch.sigmoid(x)


def apply_input_options(
    q, k, g, beta, *, A_log, dt_bias, use_qk_l2norm_in_kernel, use_gate_in_kernel,
    use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
):
    """Apply the in-kernel options of FLA's contract; inputs are already in the compute dtype."""
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)
    return q, k, g, beta


def chunk_kda_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked KDA recurrence on equal-length sequences, all inputs in one compute dtype.

    Args:
        q, k: ``[B, T, H, K]`` (already normalised if that option is on).
        v: ``[B, T, HV, V]``; g: ``[B, T, HV, K]`` log decays; beta: ``[B, T, HV]``.
        state: ``[B, HV, K, V]`` incoming state.
    Returns:
        ``o [B, T, HV, V]`` and the final state ``[B, HV, K, V]``.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    group = HV // H
    C = chunk_size
    NC = (T + C - 1) // C
    pad = NC * C - T

    def to_chunks(x: torch.Tensor) -> torch.Tensor:
        # [B, T, heads, D] -> [B, HV, NC, C, D]; q/k heads are shared by `group` value heads (GVA).
        if x.shape[2] != HV:
            x = x.repeat_interleave(group, dim=2)
        x = F.pad(x, (0, 0, 0, 0, 0, pad))  # zero tokens: g = 0, beta = 0 leave the state as it is
        return x.view(B, NC, C, HV, x.shape[-1]).permute(0, 3, 1, 2, 4)

    qc, kc, vc, gc = map(to_chunks, (q * scale, k, v, g))
    bc = to_chunks(beta.unsqueeze(-1)).squeeze(-1)  # [B, HV, NC, C]

    rows = torch.arange(C, device=q.device)
    causal = rows[:, None] >= rows[None, :]  # j <= i
    strict = rows[:, None] > rows[None, :]  # j < i
    eye = torch.eye(C, device=q.device, dtype=q.dtype)

    outputs = []
    for n in range(NC):
        qn, kn, vn, bn = qc[:, :, n], kc[:, :, n], vc[:, :, n], bc[:, :, n]
        G = gc[:, :, n].cumsum(-2)  # [B, HV, C, K]: decay from the chunk start, exp(G) only
        decay = _span_decays(gc[:, :, n], strict, causal)  # [B, HV, C(i), C(j), K]
        A_qk = torch.einsum("bhid,bhjd,bhijd->bhij", qn, kn, decay)
        A_kk = torch.einsum("bhid,bhjd,bhijd->bhij", kn, kn, decay)
        A_kk = (A_kk * bn[..., :, None]).masked_fill(~strict, 0.0)
        # T = (I + A_kk)^-1 diag(beta): one unit lower-triangular solve for both w and u.
        rhs = bn[..., None] * torch.cat([G.exp() * kn, vn], dim=-1)
        wu = torch.linalg.solve_triangular(eye + A_kk, rhs, upper=False, unitriangular=True)
        w, u = wu[..., :K], wu[..., K:]
        v_new = u - w @ state
        outputs.append((qn * G.exp()) @ state + A_qk @ v_new)
        G_last = G[..., -1:, :]  # [B, HV, 1, K]
        to_last = decay[..., -1, :, :]  # exp(sum of g over (j, C - 1]) [B, HV, C(j), K]
        state = G_last.transpose(-1, -2).exp() * state + (kn * to_last).transpose(-1, -2) @ v_new

    if NC == 0:
        o = v.new_zeros(B, HV, 0, V)
    else:
        o = torch.stack(outputs, dim=2).reshape(B, HV, NC * C, V)[:, :, :T]
    return o.transpose(1, 2), state


def _span_decays(g: torch.Tensor, strict: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """``exp(sum_{j < t <= i} g_t)`` for ``j <= i``, 0 above the diagonal: ``[..., C(i), C(j), K]`` from the
    chunk's gates ``g`` ``[..., C, K]``. Column j is a cumulative sum that starts after token j, so no
    sum carries the gates before j (exact for any gate down to -inf; no cancellation)."""
    steps = torch.where(strict[:, :, None], g[..., :, None, :], torch.zeros((), dtype=g.dtype, device=g.device))
    spans = steps.cumsum(-3)  # along i
    return spans.masked_fill(~causal[:, :, None], float("-inf")).exp()


def kda_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full KDA with FLA's semantics. Returns ``o`` in q's dtype and the final state
    ``[N, HV, K, V]`` in the compute dtype (fp32 for fp32/bf16/fp16 inputs)."""
    cdt = compute_dtype(q.dtype)
    qf, kf, vf, gf, bf = (x.to(cdt) for x in (q, k, v, g, beta))
    A_log_f = A_log.to(cdt) if A_log is not None else None
    dt_bias_f = dt_bias.to(cdt) if dt_bias is not None else None
    qf, kf, gf, bf = apply_input_options(
        qf, kf, gf, bf, A_log=A_log_f, dt_bias=dt_bias_f,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound,
    )
    return reference_over_sequences(chunk_kda_core, (qf, kf, vf, gf, bf), q, v, initial_state, cu_seqlens, scale,
                                    chunk_size)
