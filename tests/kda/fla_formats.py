"""FLA 0.6's chunk intermediates computed in plain torch (float64), for the CPU stand-ins of FLA's kernels.

FLA's formats (``fla/ops/kda/chunk_fwd.py`` and ``chunk_intra.py`` in fla-core 0.6), per chunk of
``chunk`` tokens of one sequence (chunks restart at every sequence of ``cu_seqlens``):

- ``G``: the chunk-local cumsum of the log decay in log2 units (``g / ln 2``), float32;
- ``Aqk[t, j] = scale * sum_d q_t k_j 2^(G_t - G_j)`` for ``j <= t`` (row t holds its chunk's row;
  above the diagonal FLA leaves whatever memory held), ``Akk = (I + beta_i k_i k_j 2^(G_i - G_j))^-1``
  (strictly lower part inside, zeros above);
- ``w = Akk (beta 2^G k)``, ``u = Akk (beta v)``, ``qg = q 2^G`` (unscaled), ``kg = k 2^(G_last - G)``;
- the recurrence's ``h`` (the state each chunk starts from, ``[B, chunks, HV, K, V]``) and ``v_new = u - w h``.
"""
from __future__ import annotations

import math

import torch

LN2 = math.log(2.0)


def chunk_spans(T: int, cu_seqlens: torch.Tensor | None, chunk: int) -> list[list[tuple[int, int]]]:
    """Per sequence, the ``(start, end)`` token spans of its chunks (packed along T with ``cu_seqlens``)."""
    bounds = [0, T] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    return [[(s, min(s + chunk, e)) for s in range(b, e, chunk)] for b, e in zip(bounds[:-1], bounds[1:])]


def local_cumsum(x: torch.Tensor, T: int, cu_seqlens, chunk: int, scale: float) -> torch.Tensor:
    """Chunk-local cumsum along dim 1 of ``x [B, T, ...]`` times ``scale``, float32."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for spans in chunk_spans(T, cu_seqlens, chunk):
        for s, e in spans:
            out[:, s:e] = x[:, s:e].double().cumsum(1) * scale
    return out.float()


def intra(q, k, v, G, beta, scale: float, cu_seqlens, chunk: int):
    """``(w, u, qg, kg, Aqk, Akk)`` in the inputs' dtypes from normalised ``q, k``, ``G`` (log2 cumsum) and
    activated ``beta``; ``Aqk``'s unwritten part is noise."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    f = torch.float64
    qe, ke = (x.to(f).repeat_interleave(HV // H, 2) for x in (q, k))
    vd, bd, Gd = v.to(f), beta.to(f), G.to(f)
    w, kg, qg = (torch.zeros(B, T, HV, K, dtype=f, device=q.device) for _ in range(3))
    u = torch.zeros(v.shape, dtype=f, device=q.device)
    Aqk = torch.randn(B, T, HV, chunk, dtype=f, device=q.device)
    Akk = torch.zeros(B, T, HV, chunk, dtype=f, device=q.device)
    for spans in chunk_spans(T, cu_seqlens, chunk):
        for s, e in spans:
            n = e - s
            Gc = Gd[:, s:e]
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            diff = (Gc[:, :, None] - Gc[:, None, :]).masked_fill(~causal[None, :, :, None, None], -math.inf)
            decay = diff.exp2()  # [B, i, j, HV, K]
            aqk = torch.einsum("bihd,bjhd,bijhd->bihj", qe[:, s:e], ke[:, s:e], decay) * scale  # [B, i, HV, j]
            akk = torch.einsum("bihd,bjhd,bijhd->bihj", ke[:, s:e], ke[:, s:e], decay) * bd[:, s:e, :, None]
            strict = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)
            akk = torch.where(strict[None, :, None, :], akk, 0.0)
            inv = torch.linalg.inv(torch.eye(n, dtype=f, device=q.device) + akk.permute(0, 2, 1, 3))  # [B, HV, i, j]
            Aqk[:, s:e, :, :n] = torch.where(causal[None, :, None, :], aqk, Aqk[:, s:e, :, :n])
            Akk[:, s:e, :, :n] = inv.permute(0, 2, 1, 3)
            w[:, s:e] = torch.einsum("bhij,bjhd->bihd", inv, bd[:, s:e, :, None] * ke[:, s:e] * Gc.exp2())
            u[:, s:e] = torch.einsum("bhij,bjhd->bihd", inv, bd[:, s:e, :, None] * vd[:, s:e])
            qg[:, s:e] = qe[:, s:e] * Gc.exp2()
            kg[:, s:e] = ke[:, s:e] * (Gc[:, -1:] - Gc).exp2()
    like_k = lambda x: x.to(k.dtype)  # noqa: E731
    return like_k(w), u.to(v.dtype), like_k(qg), like_k(kg), like_k(Aqk), like_k(Akk)


def states(w, u, kg, G, h0, cu_seqlens, chunk: int):
    """FLA's ``h`` ``[B, chunks, HV, K, V]`` (with ``cu_seqlens``: ``[1, total chunks, ...]``), ``v_new`` and
    the final states ``[N, HV, K, V]``, float64."""
    B, T, HV, K = w.shape
    V = u.shape[-1]
    f = torch.float64
    seqs = chunk_spans(T, cu_seqlens, chunk)
    total = sum(len(s) for s in seqs) if cu_seqlens is not None else len(seqs[0])
    h = torch.zeros(B, total, HV, K, V, dtype=f, device=w.device)
    v_new = torch.zeros(u.shape, dtype=f, device=w.device)
    finals, slot = [], 0
    for n, spans in enumerate(seqs):
        b = slice(None) if cu_seqlens is None else slice(0, 1)  # the batch rows of this sequence
        rows = B if cu_seqlens is None else 1
        S = torch.zeros(rows, HV, K, V, dtype=f, device=w.device)
        if h0 is not None:
            S += h0.to(f) if cu_seqlens is None else h0.to(f)[n:n + 1]
        for c, (s, e) in enumerate(spans):
            h[b, slot + c] = S
            vn = u[b, s:e].to(f) - torch.einsum("bihk,bhkv->bihv", w[b, s:e].to(f), S)
            v_new[b, s:e] = vn
            S = G[b, e - 1].to(f).exp2()[..., None] * S + torch.einsum("bihk,bihv->bhkv", kg[b, s:e].to(f), vn)
        if cu_seqlens is not None:
            slot += len(spans)
        finals.append(S)
    final = torch.cat(finals) if cu_seqlens is not None else finals[0]
    return h, v_new, final
