"""Dense float64 DSA, written independently of ``ops/dsa/reference.py``: the tests' oracle.

Tiny shapes only: it builds the full [B, S, H, T] logits and a dense [B, S, T] selection mask.
"""
from __future__ import annotations

import torch


def dense_visible(b, s_len, t_len, is_causal, key_mask=None, cu_seqlens=None) -> torch.Tensor:
    """bool [B, S, T]: which keys each query may select, by loops over plain ints."""
    vis = torch.zeros(b, s_len, t_len, dtype=torch.bool)
    bounds = [(0, t_len)] * s_len
    if cu_seqlens is not None:
        offsets = [int(x) for x in cu_seqlens.tolist()]
        bounds = []
        for lo, hi in zip(offsets[:-1], offsets[1:]):
            bounds += [(lo, hi)] * (hi - lo)
    for i, (lo, hi) in enumerate(bounds):
        if is_causal:
            hi = min(hi, i + t_len - s_len + 1)
        if hi > lo:
            vis[:, i, lo:hi] = True
    if key_mask is not None:
        vis &= key_mask.cpu()[:, None, :]
    return vis


def dense_scores(q, k, weights, scale) -> torch.Tensor:
    """float64 [B, S, T] indexer scores."""
    logits = torch.einsum("bshd,btd->bsht", q.double().cpu(), k.double().cpu()) * scale
    return (logits.clamp_min(0) * weights.double().cpu()[..., None]).sum(2)


def dense_topk(scores, visible, topk) -> torch.Tensor:
    """int32 [B, S, topk]: the best ``topk`` keys by (score descending, index ascending) with Python's stable
    sort, listed in ascending key order; -1 pads."""
    b, s_len, t_len = scores.shape
    out = torch.full((b, s_len, topk), -1, dtype=torch.int32)
    for bi in range(b):
        for i in range(s_len):
            keys = [t for t in range(t_len) if visible[bi, i, t]]
            keys.sort(key=lambda t: (-float(scores[bi, i, t]), t))
            keys = sorted(keys[:topk])
            out[bi, i, :len(keys)] = torch.tensor(keys, dtype=torch.int32)
    return out


def dense_sparse_attention(q, k, v, indices, scale, d_v):
    """(o [B, S, Hq, Dv], lse [B, S, Hq]) in float64 through a dense masked softmax over all T keys;
    differentiable (for gradient references)."""
    if v is None:
        v = k[..., :d_v]
    b, s_len, hq, _ = q.shape
    t_len, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    kk = k.double().repeat_interleave(g, dim=2)
    vv = v.double().repeat_interleave(g, dim=2)
    scores = torch.einsum("bshd,bthd->bsht", q.double(), kk) * scale
    mask = torch.zeros(b, s_len, t_len, dtype=torch.bool, device=q.device)
    valid = indices >= 0
    bi, si, ji = valid.nonzero(as_tuple=True)
    mask[bi, si, indices[bi, si, ji].long()] = True
    scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    o = torch.einsum("bsht,bthd->bshd", p, vv)
    return o, lse


def assert_true_topk(indices, scores, visible, topk, rtol=1e-4):
    """Where exact equality cannot be asked (continuous scores, fp32 rounding): every row holds
    min(topk, visible) unique visible keys first, in ascending key order, then -1; and no key left out
    scores above the worst one kept (up to ``rtol`` of the row's largest score)."""
    indices = indices.cpu().long()
    b, s_len, _ = indices.shape
    for bi in range(b):
        for i in range(s_len):
            row, vis, sc = indices[bi, i], visible[bi, i], scores[bi, i]
            n = min(int(vis.sum()), topk)
            assert (row[:n] >= 0).all() and (row[n:] == -1).all(), (bi, i, row.tolist(), n)
            kept = row[:n]
            assert len(set(kept.tolist())) == n and bool(vis[kept].all()), (bi, i, row.tolist())
            if n == 0:
                continue
            slack = rtol * (1.0 + float(sc[vis].abs().max()))
            assert bool((kept.diff() > 0).all()), ("not in ascending key order", bi, i)
            rest = vis.clone()
            rest[kept] = False
            if rest.any():
                assert float(sc[rest].max()) <= float(sc[kept].min()) + slack, ("a better key was left out", bi, i)
