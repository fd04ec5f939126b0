"""A per-row oracle of the block-sparse attention, independent of the reference: each (b, h, i) row's visible key
slots listed in Python from the selection's blocks, then a float64 softmax over them (0 for an empty list)."""
from __future__ import annotations

import torch


def naive_block_sparse_attention(query, key, value, block_indices, block_size, scale=None, query_positions=None,
                                 key_padding_mask=None):
    batch, heads, queries, dim = query.shape
    groups, keys = key.shape[1], key.shape[2]
    scale = dim ** -0.5 if scale is None else scale
    q, k, v = query.double(), key.double(), value.double()
    out = torch.zeros(batch, heads, queries, value.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            g = h // (heads // groups)
            for i in range(queries):
                pos = keys - queries + i if query_positions is None else int(query_positions[b, i])
                blocks = {int(n) for n in block_indices[b, g, i] if n >= 0}
                slots = [j for n in sorted(blocks) for j in range(n * block_size, min(keys, (n + 1) * block_size))
                         if j <= pos and (key_padding_mask is None or bool(key_padding_mask[b, j]))]
                if slots:
                    p = torch.softmax(scale * (k[b, g, slots] @ q[b, h, i]), 0)
                    out[b, h, i] = p @ v[b, g, slots]
    return out
