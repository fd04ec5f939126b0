"""``compressed_sparse_attention`` computed densely, as Hugging Face's DeepSeek-V4 eager code does: scores over the
window keys and the compressed entries, a mask of -inf where a query may not look, the per-head sink as one more
logit in the softmax, the sink's share dropped. [B, H, S, Tw + Tc] temporaries: the tests' oracle, for small sizes.
"""
from __future__ import annotations

import torch


def visible(batch: int, queries: int, window_keys: int, compressed: int, sliding_window: int, *,
            selected: torch.Tensor | None = None, compress_rate: int | None = None,
            query_positions: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None,
            device=None) -> torch.Tensor:
    """bool [B, S, Tw + Tc]: which keys each query sees (the op's rules, docs/dsa.md, section 6)."""
    slot = torch.arange(window_keys - queries, window_keys, device=device)[:, None]  # [S, 1]
    key = torch.arange(window_keys, device=device)[None, :]  # [1, Tw]
    window = ((key <= slot) & (key > slot - sliding_window)).expand(batch, queries, window_keys)
    if key_padding_mask is not None:
        window = window & key_padding_mask[:, None, :].to(torch.bool)
    seen = torch.zeros(batch, queries, compressed, dtype=torch.bool, device=device)
    if selected is not None:  # as Hugging Face does: a -1 lands in a spare last column, dropped after
        spare = torch.zeros(batch, queries, compressed + 1, dtype=torch.bool, device=device)
        seen = spare.scatter_(2, torch.where(selected >= 0, selected, compressed).long(), True)[..., :compressed]
    elif compress_rate is not None:
        closed = (query_positions.long() + 1) // compress_rate  # [B, S]
        seen = torch.arange(compressed, device=device)[None, None, :] < closed[..., None]
    else:
        seen = torch.ones_like(seen)  # every entry
    return torch.cat([window, seen], dim=-1)


def compressed_sparse_attention_reference(query, window_kv, compressed_kv, sinks, *, scale, sliding_window,
                                          selected=None, compress_rate=None, query_positions=None,
                                          key_padding_mask=None, dtype=torch.float64) -> torch.Tensor:
    """[B, H, S, D] in ``dtype``: softmax over the visible keys and the sink (see the module docstring)."""
    b, h, s, d = query.shape
    keys = torch.cat([window_kv, compressed_kv], dim=2).to(dtype)  # [B, 1, T, D]: keys = values
    mask = visible(b, s, window_kv.shape[2], compressed_kv.shape[2], sliding_window, selected=selected,
                   compress_rate=compress_rate, query_positions=query_positions,
                   key_padding_mask=key_padding_mask, device=query.device)
    scores = torch.matmul(query.to(dtype), keys.transpose(-1, -2)) * scale  # [B, H, S, T]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    sink = sinks.to(dtype).view(1, h, 1, 1).expand(b, h, s, 1)
    logits = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.matmul(probs, keys)
