"""Attention over N-D tensors with extra leading dims, folded into the batch dim of
``kda_compile.ops.attention``.

prophetnet's ngram predict stream (transformers 5.23 models/prophetnet/modeling_prophetnet.py,
``ProphetNetNgramSelfAttention``; its einsums become matmuls in ``attention/normalize.py``)::

    q: [B, ngram, H, S, D]; k, v: [B, ngram, H, 2S, D]
    w = torch.matmul(q, k.transpose(-1, -2)) + rel_pos + mask.permute(0, 2, 1, 3, 4)  # [B, ngram, H, S, 2S]
    p = softmax(w, dim=-1)
    out = torch.matmul(p, v)                                                          # [B, ngram, H, S, D]

The leading dims (all but the last three, [heads, seq, dim]) are batch-like: every score row is
one query against the keys of the same leading index, the softmax runs over the last dim and the
value product contracts the key dim, so attention over ``q.flatten(0, L - 1)`` (L leading dims)
with the keys and values folded alike, unflattened back, is the same attention. The mask the op gets
(everything added to or selecting the scores, combined as for 4-D attention) is folded the same way:
a mask with at most three dims, or with ones over the leading dims, broadcasts over the folded dim as it
did over the leading ones; any other mask is expanded over the leading dims, then folded (exact: the
same values per score, the broadcast materialised).

Left alone, with the reason (:func:`leading_dims`): query, keys and values of different ranks, or
whose leading dims differ (keys or values broadcast over a leading dim: the fold pairs query rows
with keys of the same folded index only). ``attention/softmax.py`` also leaves alone N-D sites with
sinks and N-D sites whose scores are read for their shape (``expand_as``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx

from kda_compile.passes.toolkit.graph_tools import erase_unused, insert_call, known_equal, known_shape_equal, tensor_of


def leading_dims(q: Any, k: Any, v: Any, fold: bool = True) -> tuple[int, str | None]:
    """(L, None) with L the number of leading dims of query, keys and values (those before [heads,
    seq, dim]: 1 for 4-D attention) when they can be folded into one batch dim; (0, reason) else.
    With ``fold`` off (rewrites that take 4-D attention only), L is 1 or there is a reason."""
    ranks = "/".join(f"{t.dim()}-D" if t is not None else "?" for t in (q, k, v))
    if any(t is None for t in (q, k, v)) or len({t.dim() for t in (q, k, v)}) != 1 or q.dim() < 4 \
            or not (fold or q.dim() == 4):
        nd = ", nor N-D ones of one rank with batch-like leading dims" if fold else ""
        return 0, f"query, keys and values are not all 4-D [batch, heads, seq, dim] tensors{nd} ({ranks})"
    lead = q.dim() - 3
    if lead > 1 and not (known_shape_equal(k.shape[:lead], q.shape[:lead])
                         and known_shape_equal(v.shape[:lead], q.shape[:lead])):
        return 0, (f"the leading dims of the {ranks} query {list(q.shape)}, keys {list(k.shape)} and values "
                   f"{list(v.shape)} differ: folding them into the batch dim needs them equal")
    return lead, None


def _sizes(graph: torch.fx.Graph, at: torch.fx.Node, query: torch.fx.Node, lead: int, inserted: list) -> list:
    """The leading sizes of ``query`` as graph values: ints, or ``query.size(d)`` where symbolic."""
    sizes = []
    for d, size in enumerate(tensor_of(query).shape[:lead]):
        if type(size) is not int:
            inserted.append(insert_call(graph, at, "size", (query, d), meta_from=at))
            size = inserted[-1]
        sizes.append(size)
    return sizes


def _fold_mask(graph: torch.fx.Graph, at: torch.fx.Node, mask: Any, query: torch.fx.Node, lead: int,
               inserted: list) -> Any:
    """``mask`` (broadcastable to the N-D scores) as a mask broadcastable to the folded scores."""
    m = tensor_of(mask) if isinstance(mask, torch.fx.Node) else None
    if m is None or m.dim() <= 3:
        return mask
    if m.dim() > lead + 3:
        raise ValueError(f"the mask {list(m.shape)} has more dims than the scores")
    extra = m.dim() - 3
    q_lead = tensor_of(query).shape[:lead]
    if all(known_equal(s, 1) for s in m.shape[:extra]):
        if extra == 1:
            return mask
        inserted.append(insert_call(graph, at, "flatten", (mask, 0, extra - 1), meta_from=at))
        return inserted[-1]
    if extra < lead or not known_shape_equal(m.shape[:extra], q_lead):
        sizes = _sizes(graph, at, query, lead, inserted)
        inserted.append(insert_call(graph, at, "expand", (mask, *sizes, -1, -1, -1), meta_from=at))
        mask = inserted[-1]
    inserted.append(insert_call(graph, at, "flatten", (mask, 0, lead - 1), meta_from=at))
    return inserted[-1]


def fold_attention(graph: torch.fx.Graph, at: torch.fx.Node, call: Any, query: torch.fx.Node, key: torch.fx.Node,
                   value: torch.fx.Node, kwargs: dict, lead: int) -> torch.fx.Node:
    """Insert ``call`` (``attention``) before ``at`` on the query, keys, values and ``kwargs["attn_mask"]``
    with their ``lead`` leading dims folded into one, and unfold its output: the N-D output. On a call that
    raises, the nodes inserted here are erased and the error re-raised (a RuntimeError as ValueError, so
    that the site is reported as refused)."""
    inserted: list[torch.fx.Node] = []
    try:
        folded = []
        for t in (query, key, value):
            inserted.append(insert_call(graph, at, "flatten", (t, 0, lead - 1), meta_from=at))
            folded.append(inserted[-1])
        kwargs = dict(kwargs, attn_mask=_fold_mask(graph, at, kwargs.get("attn_mask"), query, lead, inserted))
        inserted.append(insert_call(graph, at, call, tuple(folded), kwargs, meta_from=at))
        out = inserted[-1]
        return insert_call(graph, at, "unflatten", (out, 0, tuple(_sizes(graph, at, query, lead, inserted))),
                           meta_from=at)
    except (TypeError, ValueError, RuntimeError) as exc:
        erase_unused(graph, inserted[::-1])
        if isinstance(exc, RuntimeError):
            raise ValueError(str(exc)) from exc
        raise
