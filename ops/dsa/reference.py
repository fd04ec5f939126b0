"""DeepSeek Sparse Attention in plain torch, blockwise over queries: the CPU path and the tests' oracle.

Indexer (docs/dsa.md §1): ``score[b, i, s] = sum_h w[b, i, h] * relu(scale * q[b, i, h] . k[b, s])``
in float32, then per query the ``topk`` visible keys with the highest scores, equal scores broken by the
lower key index, returned in ascending key order. A query's visible keys are a range ``[lo_i, hi_i)`` (its
packed sequence, cut at the causal bound ``i + T - S``) intersected with ``key_mask``; fewer than ``topk``
visible keys pad with -1.

Sparse attention over the selected keys: ``s = scale * q . k[idx]`` per head (GQA: head ``h`` reads key
head ``h // (Hq / Hkv)``), ``lse = logsumexp(s)`` over the valid indices, ``o = softmax(s) @ v[idx]``;
a row without a valid index gives ``o = 0``, ``lse = -inf``.

Every function works on query blocks so that no S x T (indexer: S x H_I x T) tensor exists: a block's
temporaries are kept under ``BLOCK_BYTES``.
"""
from __future__ import annotations

import torch

from kda_compile.ops._common import out_of_range_error

BLOCK_BYTES = 64 << 20  # temporaries of one query block (CPU path); the kernels bound their own tiles
ORDER_INDEX_MASK = (1 << 31) - 1  # an order key's low 31 bits: the inverted key (or pool) index


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the attention reference computes in: at least float32."""
    return torch.promote_types(dtype, torch.float32)


def rows_per_block(bytes_per_row: int, total_rows: int) -> int:
    """How many query rows fit ``BLOCK_BYTES`` of temporaries (at least one)."""
    return max(1, min(total_rows, BLOCK_BYTES // max(1, bytes_per_row)))


# ----------------------------------------------------------------------------------------------
# Visibility
# ----------------------------------------------------------------------------------------------
def visible_ranges(queries: int, keys: int, is_causal: bool, cu_seqlens, device):
    """(lo, hi) int64 [S]: query i may see keys ``lo[i] <= s < hi[i]`` (before ``key_mask``).

    Without ``cu_seqlens`` every query's range starts at 0 and, when causal, ends after ``i + T - S``
    (bottom-right alignment: a cache of ``T - S`` earlier keys). With ``cu_seqlens`` (S == T) the range
    is the query's own packed sequence, cut after the query itself when causal. Offsets are clamped to
    ``[0, keys]``: the CUDA kernels read them unchecked unless value checks are on (``kernels.py``), and a range
    past the keys would send their top-k outside its code rows."""
    if cu_seqlens is None:  # two small kernels (decode on our Hopper kernels computes these ranges in-kernel)
        lo = torch.zeros(queries, device=device, dtype=torch.int64)
        if not is_causal:
            return lo, torch.full((queries,), keys, device=device, dtype=torch.int64)
        # query i sees keys below i + T - S + 1 (at most T), none when that is negative
        hi = torch.arange(keys - queries + 1, keys + 1, device=device, dtype=torch.int64)
        return lo, hi.clamp_min_(0) if keys - queries + 1 < 0 else hi
    pos = torch.arange(queries, device=device, dtype=torch.int64)
    offsets = cu_seqlens.to(device=device, dtype=torch.int64)
    seq = torch.searchsorted(offsets[1:], pos, right=True).clamp_max(offsets.numel() - 2)
    lo, hi = offsets[seq].clamp(0, keys), offsets[seq + 1].clamp(0, keys)
    if is_causal:
        hi = torch.minimum(hi, pos + (keys - queries) + 1)
    return lo, torch.maximum(hi, lo)


def check_cu_seqlens_values(cu_seqlens: torch.Tensor, total: int) -> None:
    """Offsets must start at 0, never decrease and end at ``total`` (reads the values: eager kernels only)."""
    offsets = cu_seqlens.to(device="cpu", dtype=torch.int64)
    if offsets[0] != 0 or offsets[-1] != total or bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing offsets from 0 to T = {total}, got "
                         f"{offsets.tolist()[:16]}{'...' if offsets.numel() > 16 else ''}")


def check_index_values(indices: torch.Tensor, keys: int) -> None:
    """The sparse attention's ``indices`` must be -1 (no key) or a key index in ``[0, T)``: anything else (an
    index past the keys, or another negative number, which a kernel would read as "no key" and hide a bug in the
    caller) is a ValueError naming the first offending entry. Reads the values (one pass; a device-to-host copy
    of two numbers on CUDA, so the CUDA kernels call it only when value checks are on: ``custom_ops``)."""
    bad = (indices < -1) | (indices >= keys)
    if bool(bad.any()):
        raise out_of_range_error("indices", indices, bad, f"-1 (no key) or key indices in [0, T) = [0, {keys})")


# ----------------------------------------------------------------------------------------------
# Top-k with the documented tie rule
# ----------------------------------------------------------------------------------------------
def order_keys(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """int64 sort keys of float32 ``scores`` [..., T]: larger key = higher score, equal scores = lower
    index larger. The high 32 bits are the score's order-preserving bit pattern (sign flip for positive
    values, all bits flipped for negative ones, -0.0 folded onto +0.0), the low 31 bits the inverted key
    index; keys a query may not see get -1, below every real key. Exact, so torch.topk on the keys is a
    deterministic top-k with the tie rule on any device."""
    s = scores.float() + 0.0  # -0.0 + 0.0 == +0.0: one bit pattern for zero
    bits = s.view(torch.int32).to(torch.int64)
    unsigned = bits & 0xFFFFFFFF
    ordered = torch.where(bits >= 0, unsigned | 0x80000000, unsigned ^ 0xFFFFFFFF)
    index = torch.arange(s.shape[-1], device=s.device, dtype=torch.int64)
    key = (ordered << 31) | (ORDER_INDEX_MASK - index)
    return torch.where(visible, key, torch.full_like(key, -1))


def topk_from_keys(keys: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 [..., topk]: the indices of the ``topk`` largest ``order_keys`` keys in ascending key order,
    then -1 (invisible keys are never chosen; rows with fewer visible keys pad)."""
    width = min(topk, keys.shape[-1])
    best = torch.topk(keys, width, dim=-1, sorted=False).values
    idx = torch.where(best >= 0, ORDER_INDEX_MASK - (best & ORDER_INDEX_MASK),
                      torch.full_like(best, ORDER_INDEX_MASK)).sort(dim=-1).values
    idx = torch.where(idx < ORDER_INDEX_MASK, idx, torch.full_like(idx, -1)).to(torch.int32)
    if width < topk:
        idx = torch.nn.functional.pad(idx, (0, topk - width), value=-1)
    return idx


def select_topk(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    return topk_from_keys(order_keys(scores, visible), topk)


# ----------------------------------------------------------------------------------------------
# Indexer
# ----------------------------------------------------------------------------------------------
def indexer_scores(q, k, weights, scale: float) -> torch.Tensor:
    """float32 [B, s, T] scores of a block of queries q [B, s, H, D] against k [B, T, D]."""
    logits = torch.einsum("bshd,btd->bsht", q.float(), k.float()) * scale
    return torch.einsum("bsht,bsh->bst", torch.relu(logits), weights.float())


def visible_block(lo, hi, key_mask, start: int, stop: int, keys: int) -> torch.Tensor:
    """bool [B or 1, stop - start, T]: which keys the queries start..stop-1 may select."""
    key = torch.arange(keys, device=lo.device)
    vis = (key[None, :] >= lo[start:stop, None]) & (key[None, :] < hi[start:stop, None])
    vis = vis[None]
    if key_mask is not None:
        vis = vis & key_mask[:, None, :]
    return vis


def indexer_topk_reference(q, k, weights, key_mask, cu_seqlens, topk: int, scale: float,
                           is_causal: bool) -> torch.Tensor:
    """int32 [B, S, topk]: the indexer's selection, blockwise over queries (temporaries per block:
    [B, s, H_I, T] float32 logits under ``BLOCK_BYTES``)."""
    b, s_len, heads, _ = q.shape
    t_len = k.shape[1]
    if cu_seqlens is not None:
        check_cu_seqlens_values(cu_seqlens, t_len)
    lo, hi = visible_ranges(s_len, t_len, is_causal, cu_seqlens, q.device)
    out = torch.empty((b, s_len, topk), dtype=torch.int32, device=q.device)
    step = rows_per_block(b * (heads + 4) * t_len * 8, s_len)
    for start in range(0, s_len, step):
        stop = min(s_len, start + step)
        scores = indexer_scores(q[:, start:stop], k, weights[:, start:stop], scale)
        vis = visible_block(lo, hi, key_mask, start, stop, t_len).expand_as(scores)
        out[:, start:stop] = select_topk(scores, vis, topk)
    return out


# ----------------------------------------------------------------------------------------------
# Sparse attention over the selected keys
# ----------------------------------------------------------------------------------------------
def _gather(x, idx):
    """x [B, T, Hkv, D] at idx [B, s, K] (clamped to 0 for -1): [B, s, K, Hkv, D]."""
    b_ix = torch.arange(x.shape[0], device=x.device)[:, None, None]
    return x[b_ix, idx.clamp_min(0).long()]


def _block_probs(qg, ks, valid, scale):
    """Scores -> (p [B, s, Hkv, G, K], lse [B, s, Hkv, G]) with invalid indices and empty rows handled."""
    scores = torch.einsum("bshgd,bskhd->bshgk", qg, ks) * scale
    scores = scores.masked_fill(~valid[:, :, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(scores - shift[..., None]), lse


def split_kv(k, v, d_v: int):
    """(k, v): the absorbed MQA form (v None) reads the value as the first d_v columns of k."""
    return k, (k[..., :d_v] if v is None else v)


def sparse_attention_reference(q, k, v, indices, scale: float, d_v: int):
    """(o [B, S, Hq, Dv] in the compute dtype, lse [B, S, Hq] float32), blockwise over queries."""
    ct = compute_dtype(q.dtype)
    b, s_len, hq, dqk = q.shape
    hkv, topk = k.shape[2], indices.shape[-1]
    groups = hq // hkv
    k, v = split_kv(k, v, d_v)
    o = torch.empty((b, s_len, hq, d_v), dtype=ct, device=q.device)
    lse = torch.empty((b, s_len, hq), dtype=torch.float32, device=q.device)
    step = rows_per_block(b * topk * (hkv * (dqk + d_v) + 2 * hq) * 8, s_len)
    for start in range(0, s_len, step):
        stop = min(s_len, start + step)
        idx = indices[:, start:stop]
        ks, vs = _gather(k, idx).to(ct), _gather(v, idx).to(ct)
        qg = q[:, start:stop].to(ct).unflatten(2, (hkv, groups))
        p, blk_lse = _block_probs(qg, ks, idx >= 0, scale)
        o[:, start:stop] = torch.einsum("bshgk,bskhd->bshgd", p, vs).flatten(2, 3)
        lse[:, start:stop] = blk_lse.flatten(2, 3).float()
    return o, lse


def sparse_attention_backward_reference(grad_o, grad_lse, q, k, v, indices, scale: float, d_v: int):
    """(dq, dk, dv) in the compute dtype (dv None when v is None: its gradient lands in dk[..., :d_v]).

    Recomputes each query block's probabilities, then ``dS = P * (dP - rowsum(dO * O) + dlse)``;
    dq = scale * dS @ K_sel and the per-selection dk / dv are scatter-added onto the keys (many queries
    select the same key). Temporaries per block as in the forward; never S x T."""
    ct = compute_dtype(q.dtype)
    b, s_len, hq, dqk = q.shape
    hkv, topk = k.shape[2], indices.shape[-1]
    groups = hq // hkv
    k_full, v_full = split_kv(k, v, d_v)
    dq = torch.empty((b, s_len, hq, dqk), dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=q.device)
    dv = torch.zeros(v_full.shape, dtype=ct, device=q.device) if v is not None else None
    b_ix = torch.arange(b, device=q.device)[:, None, None]
    step = rows_per_block(b * topk * (hkv * 2 * (dqk + d_v) + 4 * hq) * 8, s_len)
    for start in range(0, s_len, step):
        stop = min(s_len, start + step)
        idx = indices[:, start:stop]
        valid = idx >= 0
        ks, vs = _gather(k_full, idx).to(ct), _gather(v_full, idx).to(ct)
        qg = q[:, start:stop].to(ct).unflatten(2, (hkv, groups))
        dog = grad_o[:, start:stop].to(ct).unflatten(2, (hkv, groups))
        p, _ = _block_probs(qg, ks, valid, scale)
        og = torch.einsum("bshgk,bskhd->bshgd", p, vs)
        delta = (dog * og).sum(-1)
        if grad_lse is not None:
            delta = delta - grad_lse[:, start:stop].to(ct).unflatten(2, (hkv, groups))
        dp = torch.einsum("bshgd,bskhd->bshgk", dog, vs)
        ds = p * (dp - delta[..., None])
        dq[:, start:stop] = (torch.einsum("bshgk,bskhd->bshgd", ds, ks) * scale).flatten(2, 3)
        keep = valid[..., None, None].to(ct)
        dk_sel = torch.einsum("bshgk,bshgd->bskhd", ds, qg) * scale * keep
        dv_sel = torch.einsum("bshgk,bshgd->bskhd", p, dog) * keep
        safe = idx.clamp_min(0).long()
        dk.index_put_((b_ix.expand_as(safe), safe), dk_sel, accumulate=True)
        if dv is None:
            dk[..., :d_v].index_put_((b_ix.expand_as(safe), safe), dv_sel, accumulate=True)
        else:
            dv.index_put_((b_ix.expand_as(safe), safe), dv_sel, accumulate=True)
    return dq, dk, dv
