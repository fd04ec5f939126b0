"""MiniMax-M3's block-sparse attention in plain torch: the CPU / float64 path, the backward, and the tests' oracle.

The visible keys are built exactly as Hugging Face's ``MiniMaxM3VLIndexer.build_block_mask`` builds its dense mask
(transformers 5.23, ``models/minimax_m3_vl/modeling_minimax_m3_vl.py``): the selected blocks of a group are
scattered into a per-block keep flag (an empty slot, -1, lands in a throwaway column), the flags are repeated
``block_size`` times along the keys and cut at T, then combined with the causal bound (key slot ``j`` visible
to a query at position ``p`` when ``j <= p``) and the padding mask. A repeated block is the same flag set twice:
harmless here, which is why the op accepts duplicates (the kernel skips them: ``triton_forward.py``).

Then dense softmax attention under that mask in float32 (float64 stays float64), over the group's query heads
without repeating keys. A row without a visible key gives ``out = 0`` and ``lse = -inf`` (HF's additive mask of
``finfo.min`` would instead average every value there; HF's indexer never makes such a row, as the query's own
block is always selected). Memory is O(B * H * Sq * T): an oracle, not a long-context path.
"""
from __future__ import annotations

import torch

from kda_compile.ops._common import out_of_range_error


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32."""
    return torch.promote_types(dtype, torch.float32)


def num_key_blocks(keys: int, block_size: int) -> int:
    """``ceil(T / block_size)``: the number of blocks that cover the T key slots (the last may be partial)."""
    return -(-keys // block_size)


def default_positions(batch: int, queries: int, keys: int, device) -> torch.Tensor:
    """int64 [B, Sq]: query i at position ``T - Sq + i`` (bottom-right aligned, as HF's default)."""
    return torch.arange(keys - queries, keys, device=device, dtype=torch.int64).expand(batch, queries)


def check_block_index_values(block_indices: torch.Tensor, keys: int, block_size: int) -> None:
    """Every entry of ``block_indices`` must be -1 (an empty slot) or a block index in ``[0, ceil(T / block_size))``:
    anything else is a ValueError naming the first such entry. Reads the values (a device-to-host copy on CUDA:
    the op calls it there only when value checks are on, ``ops._common.values_checked``)."""
    blocks = num_key_blocks(keys, block_size)
    bad = (block_indices < -1) | (block_indices >= blocks)
    if bool(bad.any()):
        raise out_of_range_error("block_indices", block_indices, bad,
                                 f"-1 (empty slot) or block indices in [0, ceil(T / block_size)) = [0, {blocks})")


def visible_keys(block_indices: torch.Tensor, keys: int, block_size: int, query_positions: torch.Tensor | None,
                 key_padding_mask: torch.Tensor | None) -> torch.Tensor:
    """bool [B, G, Sq, T]: whether query i of group g may see key slot j (HF's ``build_block_mask`` + causal)."""
    batch, groups, queries, _ = block_indices.shape
    device = block_indices.device
    blocks = num_key_blocks(keys, block_size)
    safe = block_indices.long().masked_fill(block_indices < 0, blocks)  # -1 -> the throwaway column
    keep = torch.zeros((batch, groups, queries, blocks + 1), dtype=torch.bool, device=device)
    keep.scatter_(-1, safe, True)
    keep = keep[..., :blocks].repeat_interleave(block_size, dim=-1)[..., :keys]
    if query_positions is None:
        query_positions = default_positions(batch, queries, keys, device)
    slots = torch.arange(keys, device=device)
    keep = keep & (slots[None, None, None, :] <= query_positions.long()[:, None, :, None])
    if key_padding_mask is not None:
        keep = keep & key_padding_mask[:, None, None, :]
    return keep


def block_sparse_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                     block_indices: torch.Tensor, block_size: int, scale: float,
                                     query_positions: torch.Tensor | None = None,
                                     key_padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, Sq, Dv] in the compute dtype, lse [B, H, Sq] natural log, -inf for a row without a key).

    query [B, H, Sq, D], key [B, G, T, D], value [B, G, T, Dv]; heads ``h`` read group ``h // (H / G)``.
    Differentiable in query, key and value (no NaN gradient for rows without a key)."""
    batch, heads, queries, dim = query.shape
    groups, keys = key.shape[1], key.shape[2]
    per_group = heads // groups
    dtype = compute_dtype(query.dtype)
    q = query.to(dtype).reshape(batch, groups, per_group, queries, dim)
    k, v = key.to(dtype), value.to(dtype)
    visible = visible_keys(block_indices, keys, block_size, query_positions, key_padding_mask)[:, :, None]
    scores = torch.matmul(q, k[:, :, None].transpose(-1, -2)) * scale  # [B, G, H/G, Sq, T]
    scores = scores.masked_fill(~visible, float("-inf"))
    alive = visible.any(-1, keepdim=True)
    scores = torch.where(alive, scores, 0.0)  # rows without a key: finite, so no NaN in the backward
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse) * alive
    out = torch.matmul(probs, v[:, :, None])
    lse = torch.where(alive, lse, float("-inf"))
    return out.reshape(batch, heads, queries, value.shape[-1]), lse.reshape(batch, heads, queries)
