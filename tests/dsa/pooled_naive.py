"""A dense float64 oracle of glm5_next's pooled indexer that follows Hugging Face's
``Glm5NextTextIndexer.forward`` step by step ([B, S, T] visibility, [B, S, NP] scores), with the tie rule
of ``dsa_pooled_indexer_topk`` (equal scores: the lower pool index) by a stable sort; and a helper that
runs HF's own module on given indexer inputs."""
from __future__ import annotations

import torch


def dense_pooled(q, k, gate, weights, key_valid, ape, query_mask, topk, scale, q_offset, select_tail):
    """int32 [B, S, topk (+ P - 1)]; scores in float64."""
    b, s_len, _, _ = q.shape
    t_len, pool = k.shape[1], ape.shape[0]
    if key_valid is None:
        key_valid = torch.ones(b, t_len, dtype=torch.bool)
    pos = q_offset + torch.arange(s_len)
    visible = (torch.arange(t_len)[None, None, :] <= pos[None, :, None]) & key_valid[:, None, :]
    first = torch.where(key_valid.any(-1), key_valid.long().argmax(-1), torch.full((b,), t_len))
    n_pools = (t_len + pool - 1) // pool
    tok = first[:, None, None] + torch.arange(n_pools * pool).view(1, n_pools, pool)
    safe = tok.clamp(0, t_len - 1)
    b_ix = torch.arange(b)[:, None, None]
    valid = key_valid[b_ix, safe] & (tok < t_len)
    pool_valid = valid.all(-1)
    logits = (gate[b_ix, safe].double() + ape.double()[None, None]).masked_fill(~valid[..., None], float("-inf"))
    probs = torch.nan_to_num(logits.softmax(dim=2))
    pk = (probs * k[b_ix, safe].double()).sum(2)
    keep = pool_valid.any(0)
    pk, pool_valid, tok = pk[:, keep], pool_valid[:, keep], tok[:, keep]
    scores = torch.relu(torch.einsum("bshd,bpd->bshp", q.double(), pk) * scale)
    scores = torch.einsum("bshp,bsh->bsp", scores, weights.double())
    last = tok[..., -1].clamp(0, t_len - 1)
    cand = visible.gather(-1, last[:, None, :].expand(b, s_len, -1)) & pool_valid[:, None]
    n_sel = min(topk // pool, scores.shape[-1])
    width = topk + (pool - 1 if select_tail else 0)
    out = torch.full((b, s_len, width), -1, dtype=torch.long)
    for bi in range(b):
        for i in range(s_len):
            order = sorted((p for p in range(scores.shape[-1]) if cand[bi, i, p]),
                           key=lambda p: -float(scores[bi, i, p]))[:n_sel]
            for slot, p in enumerate(order):
                out[bi, i, slot * pool:(slot + 1) * pool] = tok[bi, p]
            if select_tail and pool > 1:
                count = int(visible[bi, i].sum())
                tail = count % pool
                start = int(first[bi]) + count - tail
                for j in range(pool - 1):
                    s = start + j
                    if j < tail and s < t_len and bool(visible[bi, i, s]):
                        out[bi, i, n_sel * pool + j] = s
    if query_mask is not None:
        out[~query_mask] = -1
    return out.to(torch.int32)


class _Layer:
    def __init__(self, packed, length):
        self.keys = packed.new_empty(packed.shape[0], 1, packed.shape[1], 1)  # only .shape[-2] is read
        self.length = length

    def get_seq_length(self):
        return self.length


class StubCache:
    """Stands in for HF's cache: ``update_indexer`` returns the given [B, T, 2D + 1] packed states (the
    cache after this step's write), ``get_seq_length`` the filled length (``< T`` mimics a static cache)."""

    def __init__(self, packed, length, layer_idx=0):
        self.packed = packed
        self.layers = {layer_idx: _Layer(packed, length)}

    def update_indexer(self, packed_states, layer_idx):
        return self.packed


def hf_inputs(module, hidden, q_resid):
    """(q, k, gate, weights) exactly as HF's forward computes them from the hidden states."""
    b, s = hidden.shape[:2]
    q = module.wq_b(q_resid).view(b, s, -1, module.head_dim)
    k = module.k_norm(module.wk(hidden))
    gate = torch.nn.functional.linear(hidden, module.index_kpool_compress_gate)
    weights = module.weights_proj(hidden).float() * module.n_heads ** -0.5
    return q, k, gate, weights
