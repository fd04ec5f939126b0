"""glm5_next's pooled DSA indexer in plain torch, blockwise: the op's CPU path, the reference of its CUDA
kernels (``pooled/triton_indexer.py``, which share this file's pooling, merge and layout steps) and the math the tests
check against Hugging Face's ``Glm5NextTextIndexer``.

The keys are grouped into pools of ``P`` consecutive tokens starting at each row's first valid key
(``first[b]``; left padding is skipped): pool ``p`` holds the tokens ``first + p * P + j``, ``j < P``, and is
*valid* when all of them exist (``< T``) and are valid keys. Its key is a softmax-gated mean::

    g[b, p, j]  = softmax_j(gate[b, tok] + ape[j])                 (float32; invalid tokens excluded)
    pk[b, p]    = sum_j g[b, p, j].to(k.dtype) * k[b, tok]         (in k's dtype, as HF sums it)

Query ``i`` sits at position ``pos_i = q_offset + i`` and sees a valid key ``s`` when ``s <= pos_i``. It
scores the valid pools whose last token it sees (float32, as HF):
``score[b, i, p] = sum_h weights[b, i, h] * relu(scale * q[b, i, h] . pk[b, p])`` and keeps the best
``n_sel = min(topk // P, n_kept)`` pools, where ``n_kept`` counts the pools valid in at least one batch row
(HF drops the others before its top-k). The output row is the selected pools' tokens (``P`` each, pools by
score descending, equal scores by the lower pool index; a slot without a pool is ``P`` times -1), then, with
``select_tail``, the visible tail (the ``P - 1`` slots after the pools: the tokens past the last complete
pool, ``cnt % P`` of them, ``cnt`` = the query's visible count), then -1 up to ``topk (+ P - 1)``; rows of
padded queries (``query_mask`` False) are all -1.

No host-device synchronisation (a decode call can be captured in a CUDA graph): every loop bound and size comes
from shapes and the caller's ``q_offset``. The running top-k keeps ``slots = min(topk // P, T // P)`` pools (no
pool past ``T // P`` is ever complete, so ``n_kept <= slots``); a query sees at most ``n_kept`` pools, so the
slots past ``n_sel`` hold -1 and equal the layout above. ``n_sel`` itself stays on the device: the tail is
scattered to the columns ``n_sel * P + j``.

Memory: the pool keys are formed a block of pools at a time (``pooled_keys``: no copy of the key cache, only
``pk`` itself, ``[B, T / P, D]``); queries go in blocks and the pools in blocks, with a running top-k of int64
order keys (the tie rule of ``reference.order_keys``), so the largest temporary is one block's
``[B, s_blk, H_I, p_blk]`` float32 logits (under ``BLOCK_BYTES``): no ``[B, S, T]`` or ``[B, S, H_I, T]``
tensor (nor ``[B, S, T / P]``) exists. The work stops at the last pool the block's queries can see from key 0
(causal prefill: half; rows with left padding see fewer, their extra pools are masked).
"""
from __future__ import annotations

import logging

import torch

from kda_compile.ops.dsa.reference import BLOCK_BYTES, ORDER_INDEX_MASK

logger = logging.getLogger("kda_compile.ops.dsa.pooled.reference")

POOL_BLOCK = 1024  # pools scored per step of the running top-k (tests lower it to exercise the merge)
QUERY_BLOCK = 1 << 30  # an upper bound on the query block (the byte budget decides; tests lower it)


def output_width(topk: int, pool: int, select_tail: bool) -> int:
    """HF's ``index_topk`` plus ``index_kpool - 1`` tail slots when the tail is appended."""
    return topk + (pool - 1 if select_tail else 0)


def first_valid(key_valid: torch.Tensor) -> torch.Tensor:
    """int64 [B]: each row's first valid key, T for a row without one (argmax gives the first maximum)."""
    t_len = key_valid.shape[1]
    if t_len == 0:
        return torch.zeros(key_valid.shape[0], dtype=torch.long, device=key_valid.device)
    first = key_valid.view(torch.uint8).argmax(-1)
    return torch.where(key_valid.gather(1, first[:, None])[:, 0], first, t_len)


def as_mask(key_valid):
    """The bool key mask of ``key_valid``: None (every key valid) and bool masks as they are; floating flags (HF's
    cache column) as ``!= 0``, which is ``Tensor.bool``'s reading (NaN counts as valid)."""
    if key_valid is None or key_valid.dtype == torch.bool:
        return key_valid
    return key_valid != 0


def mask_first_and_pools(k, gate, key_valid, ape, pools=None):
    """(key_valid bool or None, first [B], pk, pool_valid): the key mask (``as_mask``), each row's first valid key
    (zeros without a mask) and the pools that ``pools(k, gate, mask, ape, first)`` forms (default ``pooled_keys``,
    in torch; the CUDA path passes its kernels')."""
    key_valid = as_mask(key_valid)
    if key_valid is None:
        first = torch.zeros(k.shape[0], dtype=torch.long, device=k.device)
    else:
        first = first_valid(key_valid)
    return (key_valid, first, *(pools or pooled_keys)(k, gate, key_valid, ape, first))


def empty_pools(k, pool: int):
    """(pk [B, NP, D] of k's dtype, pool_valid bool [B, NP]), uninitialised, NP = ceil(T / pool): what every way of
    forming the pools fills."""
    b, t_len, d = k.shape
    n_pools = (t_len + pool - 1) // pool
    return k.new_empty((b, n_pools, d)), torch.empty((b, n_pools), dtype=torch.bool, device=k.device)


def pooled_keys(k, gate, key_valid, ape, first):
    """(pk [B, NP, D] in k's dtype, pool_valid bool [B, NP]): the softmax-gated pools (module docstring);
    ``key_valid`` None: every key is valid (``first`` is then zeros).

    In blocks of pools whose temporaries (the gathered keys and gates, their product, the indices) stay under
    ``BLOCK_BYTES``: a decode step over a long cache never holds a copy of the whole key cache. Each pool is
    formed on its own, so the blocks do not change a bit of the result."""
    b, t_len, d = k.shape
    pool = ape.shape[0]
    pk, pool_valid = empty_pools(k, pool)
    n_pools = pk.shape[1]
    per_pool = b * pool * (d * (2 * k.element_size() + 12) + 64)  # keys, product, gates (fp32 x3), indices
    step = max(1, BLOCK_BYTES // max(1, per_pool))
    b_ix = torch.arange(b, device=k.device)[:, None, None]
    ape32 = ape.float()[None, None]
    for p0 in range(0, n_pools, step):
        p1 = min(n_pools, p0 + step)
        tok = first[:, None, None] + torch.arange(p0 * pool, p1 * pool, device=k.device).view(1, p1 - p0, pool)
        safe = tok.clamp(0, max(t_len - 1, 0))
        valid = tok < t_len
        if key_valid is not None:
            valid = valid & key_valid[b_ix, safe]
        logits = gate[b_ix, safe].float() + ape32
        logits = logits.masked_fill(~valid[..., None], float("-inf"))
        probs = torch.nan_to_num(logits.softmax(dim=2)).to(k.dtype)
        pk[:, p0:p1] = (probs * k[b_ix, safe]).sum(dim=2)
        pool_valid[:, p0:p1] = valid.all(-1)
    return pk, pool_valid


def _order_keys(scores: torch.Tensor, visible: torch.Tensor, start: int) -> torch.Tensor:
    """int64 keys of float32 ``scores`` [..., n] for pools ``start..start+n-1`` (``reference.order_keys``'s
    rule: score descending, equal scores by the lower pool index; -1 for a pool the query may not take)."""
    s = scores.float() + 0.0
    bits = s.view(torch.int32).to(torch.int64)
    unsigned = bits & 0xFFFFFFFF
    ordered = torch.where(bits >= 0, unsigned | 0x80000000, unsigned ^ 0xFFFFFFFF)
    index = torch.arange(start, start + s.shape[-1], device=s.device, dtype=torch.int64)
    key = (ordered << 31) | (ORDER_INDEX_MASK - index)
    return torch.where(visible, key, torch.full_like(key, -1))


def visible_count(key_valid, pos: torch.Tensor, q_offset: int, batch: int, t_len: int) -> torch.Tensor:
    """int64 [B, S]: how many valid keys ``s <= pos_i`` each query sees (``pos = q_offset + arange(S)``; no [S, T]).
    The keys before the first query's are summed, a prefix sum runs only over the queries' own positions: a
    decode step sums its row instead of scanning it. ``key_valid`` None: every key is valid."""
    upto = (pos + 1).clamp(0, t_len)
    if key_valid is None:
        return upto.expand(batch, pos.shape[0])
    lo, hi = min(max(q_offset + 1, 0), t_len), min(max(q_offset + pos.shape[0], 0), t_len)  # upto's range
    base = key_valid[:, :lo].sum(-1, keepdim=True)
    window = torch.cat((key_valid.new_zeros((batch, 1), dtype=torch.long), key_valid[:, lo:hi].long().cumsum(-1)),
                       dim=1)
    return base + window[:, upto - lo]


def _tail(key_valid, first, pos, pool: int, q_offset: int, batch: int, t_len: int) -> torch.Tensor:
    """int64 [B, S, P - 1]: HF's ``append_visible_tail``, from the visible counts."""
    count = visible_count(key_valid, pos, q_offset, batch, t_len)
    tail_count = count.remainder(pool)
    offsets = torch.arange(pool - 1, device=pos.device)
    tail = (first[:, None] + count - tail_count)[..., None] + offsets
    safe = tail.clamp(0, max(t_len - 1, 0))
    seen = safe <= pos[None, :, None]
    if key_valid is not None:
        b_ix = torch.arange(batch, device=pos.device)[:, None, None]
        seen = seen & key_valid[b_ix, safe]
    keep = (offsets < tail_count[..., None]) & (tail < t_len) & seen
    return tail.masked_fill(~keep, -1)


def pool_slots(topk: int, pool: int, t_len: int) -> int:
    """The running top-k's width, from shapes: HF's ``topk // P`` pools, at most the ``T // P`` pools that can
    be complete (pool ``p`` ends at ``first + p * P + P - 1 < T`` with ``first >= 0``)."""
    return min(topk // pool, t_len // pool)


def prepare(q, k, gate, key_valid, ape, topk: int, q_offset: int, form_pools=None):
    """What both implementations start from: (key_valid, first [B], pos [S], pk [B, NP, D], pool_valid [B, NP],
    slots, n_sel); ``key_valid`` comes back as a bool mask (``as_mask``), None staying None (every key valid,
    ``first`` zeros: no [B, T] mask is made). ``slots`` (``pool_slots``) is an int from shapes; ``n_sel`` = HF's
    ``min(topk // P, n_kept)`` is an int64 0-dim tensor on the device (it places the tail; never read on the host).
    ``form_pools(k, gate, key_valid, ape)``: what makes the mask, the first valid keys and the pools (default
    ``mask_first_and_pools``; the CUDA path passes its own, ``triton_indexer.form_pools``)."""
    b, s_len = q.shape[:2]
    t_len, pool = k.shape[1], ape.shape[0]
    pos = q_offset + torch.arange(s_len, device=q.device, dtype=torch.long)
    key_valid, first, pk, pool_valid = (form_pools or mask_first_and_pools)(k, gate, key_valid, ape)
    n_sel = pool_valid.any(0).sum().clamp(max=topk // pool)  # HF drops pools no row has, then tops k
    return key_valid, first, pos, pk, pool_valid, pool_slots(topk, pool, t_len), n_sel


def pool_reach(last_pos: int, pool: int, n_pools: int) -> int:
    """How many pools (from pool 0) a block of queries up to position ``last_pos`` may see, from shapes: pool
    ``p`` of a row ends at ``first + p * P + P - 1 >= p * P + P - 1``, so the pools past this bound are never
    candidates (rows with left padding see fewer; their extra pools are masked, not skipped)."""
    return max(0, min(n_pools, (last_pos - (pool - 1)) // pool + 1))


def merge_best(best, keys: torch.Tensor, slots: int) -> torch.Tensor:
    """The running top-k: int64 [..., slots], the ``slots`` largest order keys of ``best`` (None before the first
    pool block) and ``keys``, descending, -1 where fewer keys exist."""
    if best is not None:
        keys = torch.cat((best, keys), dim=-1)
    width = min(slots, keys.shape[-1])
    top = torch.topk(keys, width, dim=-1, sorted=True).values
    if width < slots:
        top = torch.nn.functional.pad(top, (0, slots - width), value=-1)
    return top


def write_pools(out: torch.Tensor, start: int, stop: int, best: torch.Tensor, first: torch.Tensor, pool: int):
    """Expand the chosen pools' order keys ``best`` [B, stop - start, slots] into their tokens in ``out``."""
    slots = best.shape[-1]
    chosen = torch.where(best >= 0, ORDER_INDEX_MASK - (best & ORDER_INDEX_MASK), torch.full_like(best, -1))
    tokens = first[:, None, None, None] + chosen[..., None] * pool + torch.arange(pool, device=best.device)
    tokens = torch.where(chosen[..., None] >= 0, tokens, torch.full_like(tokens, -1))
    out[:, start:stop, :slots * pool] = tokens.flatten(-2).to(torch.int32)


def finish(out, key_valid, first, pos, pool: int, n_sel: torch.Tensor, select_tail: bool,
           query_mask, q_offset: int, t_len: int) -> torch.Tensor:
    """The tail after the ``n_sel`` pools and the padded queries' -1 rows (both implementations). ``n_sel`` (a
    device tensor) places the tail by a scatter; the columns it writes held -1 (pool slots past ``n_sel``, which
    no query fills, or padding), so the row is HF's layout."""
    if select_tail and pool > 1:
        tail = _tail(key_valid, first, pos, pool, q_offset, out.shape[0], t_len).to(torch.int32)
        cols = n_sel * pool + torch.arange(pool - 1, device=out.device)
        out.scatter_(2, cols.expand(tail.shape), tail)
    if query_mask is not None:
        out.masked_fill_(~query_mask[..., None], -1)
    return out


def pooled_indexer_topk_reference(q, k, gate, weights, key_valid, ape, query_mask, topk: int, scale: float,
                                  q_offset: int, select_tail: bool) -> torch.Tensor:
    """int32 [B, S, topk (+ P - 1 with the tail)]: the pooled selection (module docstring), blockwise."""
    b, s_len, heads, _ = q.shape
    pool = ape.shape[0]
    out = torch.full((b, s_len, output_width(topk, pool, select_tail)), -1, dtype=torch.int32, device=q.device)
    if b == 0 or s_len == 0:
        return out
    key_valid, first, pos, pk, pool_valid, slots, n_sel = prepare(q, k, gate, key_valid, ape, topk, q_offset)
    n_pools = k.shape[1] // pool  # the pools that can be complete (pool_slots)
    if slots > 0:
        pool_last = first[:, None] + torch.arange(n_pools, device=q.device) * pool + (pool - 1)  # [B, NP]
        pk32, w32 = pk.float(), weights.float()
        step = min(QUERY_BLOCK, s_len, max(1, BLOCK_BYTES // max(1, b * (heads + 6) * min(POOL_BLOCK, n_pools) * 8)))
        for start in range(0, s_len, step):
            stop = min(s_len, start + step)
            reach = pool_reach(q_offset + stop - 1, pool, n_pools)
            best = None
            qb = q[:, start:stop].float()
            for p0 in range(0, reach, POOL_BLOCK):
                p1 = min(reach, p0 + POOL_BLOCK)
                logits = torch.relu(torch.einsum("bshd,bpd->bshp", qb, pk32[:, p0:p1]) * scale)
                scores = torch.einsum("bshp,bsh->bsp", logits, w32[:, start:stop])
                visible = pool_valid[:, None, p0:p1] & (pool_last[:, None, p0:p1] <= pos[None, start:stop, None])
                best = merge_best(best, _order_keys(scores, visible, p0), slots)
            if best is not None:
                write_pools(out, start, stop, best, first, pool)
    return finish(out, key_valid, first, pos, pool, n_sel, select_tail, query_mask, q_offset, k.shape[1])
