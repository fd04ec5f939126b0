"""The graph patterns of the DSA rewrite (passes/dsa/attention.py), as Hugging Face's DSA code writes
them in transformers 5.23 (models/deepseek_v32 and the families that copy it; docs/dsa-rewrite.md), and
the modeling modules of the block-sparse variants the rewrite reports as left alone."""
from __future__ import annotations

import math
import operator
from types import SimpleNamespace
from typing import Any

import torch
import torch.fx

from kda_compile.passes.attention.mask import AND, COMPARE, NEW_ONES, UNSQUEEZE
from kda_compile.passes.toolkit.graph_tools import is_tensor_node, module_path
from kda_compile.passes.toolkit.matching import (ADD, CAST, MATMUL, MUL, TRANSPOSE, Call, Capture, Const, OneOf,
                                                 cast_dtype, family)

# Block-sparse DSA variants: their indexers score compressed / pooled key blocks, which the token-level
# indexer op does not compute (glm5_next's pooled indexer has its own op: passes/dsa/pooled.py; qwen4_exp's
# QSA indexer is traced branch-free, passes/dsa/qsa_indexer.py, and its attention is softmax attention under the
# selection mask; minimax_m3_vl's block selections feed block_sparse_attention, passes/dsa/block_sparse.py).
# Keyed on the transformers modeling module -> (the module class suffix the
# report names, reason); a new variant is one more entry.
BLOCK_SPARSE_MODULES: dict[str, tuple[str, str]] = {}  # deepseek_v4: passes/dsa/compressed.py

TOPK = family("topk", ("input", "k", "dim", "largest", "sorted"), functions=(torch.topk,), methods=("topk",),
              defaults={"dim": -1, "largest": True, "sorted": True})
RELU = family("relu", ("input", "inplace"), functions=(torch.nn.functional.relu, torch.relu), methods=("relu",),
              defaults={"inplace": False})
SQUEEZE = family("squeeze", ("input", "dim"), functions=(torch.squeeze,), methods=("squeeze",))
MASKED_FILL = family("masked_fill", ("input", "mask", "value"), functions=(torch.masked_fill,),
                     methods=("masked_fill",))
INVERT = family("invert", ("input",), functions=(operator.invert, torch.bitwise_not, torch.logical_not),
                methods=("__invert__", "bitwise_not", "logical_not"))
SCATTER = family("scatter", ("input", "dim", "index", "value"), functions=(torch.scatter,), methods=("scatter",),
                 aliases={"src": "value"})
LONG = family("long", ("input",), methods=("long",))
NEW_FULL = family("new_full", ("input", "size", "fill_value"), methods=("new_full",),
                  defaults={"dtype": None, "device": None, "requires_grad": False})
SCATTER_ = family("scatter_", ("input", "dim", "index", "value"), methods=("scatter_",), aliases={"src": "value"})


def _dim_is(*accepted: int) -> Const:
    return Const(where=lambda d: isinstance(d, int) and not isinstance(d, bool) and d in accepted)


def _to_float32(node: torch.fx.Node) -> bool:
    return cast_dtype(node) == torch.float32


def _maybe_fp32(inner):
    """``x.float()`` or ``x`` itself (an fp32 model has nothing to cast)."""
    return OneOf(Call(CAST, where=_to_float32, input=inner), inner)


def _swaps_last_two_3d(node: torch.fx.Node) -> bool:
    b = TRANSPOSE.bind(node)
    dims = {d % 3 if isinstance(d, int) else None for d in (b["dim0"], b["dim1"])} if b is not None else set()
    return dims == {1, 2}


def is_minus_inf(value: Any) -> bool:
    return isinstance(value, float) and value == -math.inf


# q [B, S, H, D] @ k^T [B, 1, D, T] -> [B, S, H, T]; the transpose and casts may come in either order
KEYS_T = OneOf(
    Call(UNSQUEEZE, dim=_dim_is(1), input=_maybe_fp32(Call(TRANSPOSE, where=_swaps_last_two_3d,
                                                           input=Capture("k", is_tensor_node)))),
    Call(UNSQUEEZE, dim=_dim_is(1), input=Call(TRANSPOSE, where=_swaps_last_two_3d, input=Call(
        CAST, where=_to_float32, input=Capture("k", is_tensor_node)))))
PAIR_SCORES = Call(MATMUL, name="pair_scores", input=_maybe_fp32(Capture("q", is_tensor_node)), other=KEYS_T)
SCALED = OneOf(Call(MUL, commutative=True, input=PAIR_SCORES, other=Const("scale", symbolic=True)), PAIR_SCORES)
HEAD_SUM = Call(SQUEEZE, dim=_dim_is(-2, 2), input=Call(
    MATMUL, input=Call(UNSQUEEZE, dim=_dim_is(-2, 2), input=Capture("weights", is_tensor_node)),
    other=Call(RELU, inplace=False, input=SCALED)))
MASKED_SCORES = OneOf(
    Call(ADD, commutative=True, input=HEAD_SUM, other=Capture("mask_slice", is_tensor_node)),
    Call(MASKED_FILL, input=HEAD_SUM, mask=Call(INVERT, input=Capture("mask_slice", is_tensor_node)),
         value=Const(where=is_minus_inf)))
SELECTION = Call(TOPK, name="topk", input=MASKED_SCORES, dim=_dim_is(-1, 2), largest=True,
                 k=Capture("topk_k"))

# glm5_next: its indices are -1 padded and already visible-only; the mask is the selection alone:
#   counts = torch.zeros(B, S, T, dtype=torch.int32); valid = topk_indices.ge(0) & topk_indices.lt(T)
#   counts.scatter_add_(-1, topk_indices.clamp(0, T - 1), valid.to(torch.int32)); mask = counts.ne(0).unsqueeze(1)
SCATTER_ADD_ = family("scatter_add_", ("input", "dim", "index", "src"), methods=("scatter_add_",))
CLAMP = family("clamp", ("input", "min", "max"), functions=(torch.clamp,), methods=("clamp",),
               defaults={"min": None, "max": None})
COUNTS = Call(SCATTER_ADD_, name="scatter_add", dim=_dim_is(-1, 2), input=Capture("counts", is_tensor_node),
              index=Call(CLAMP, name="safe", input=Capture("indices", is_tensor_node), min=0),
              src=Call(CAST, name="valid_count", input=Call(AND, name="valid", input=Call(
                  COMPARE[operator.ge], name="ge", input=Capture("indices"), other=0), other=Call(
                  COMPARE[operator.lt], name="lt", input=Capture("indices")))))

# topk_indices.new_ones((B, S, T), dtype=bool).scatter(-1, topk_indices.long(), False).unsqueeze(1)
INDEX_MASK = Call(UNSQUEEZE, name="index_mask", dim=_dim_is(1), input=Call(
    SCATTER, name="scatter", dim=_dim_is(-1, 2), value=False,
    input=Call(NEW_ONES, name="ones", input=Capture("template")),
    index=Call(LONG, input=Capture("indices", is_tensor_node))))


def is_mask_slice(index: Any) -> bool:
    """``mask[:, 0]`` / ``mask[:, 0, :, :]``: the [B, S, T] view of a [B, 1, S, T] mask."""
    full = slice(None, None, None)
    return isinstance(index, tuple) and index in ((full, 0), (full, 0, full, full), (full, 0, Ellipsis))


def block_sparse_sites(graph: torch.fx.Graph) -> dict[str, str]:
    """Attention modules of the block-sparse DSA variants in this graph: module path -> reason."""
    found: dict[str, str] = {}
    for node in graph.nodes:
        for path, cls in (node.meta.get("nn_module_stack") or {}).values():
            suffix, reason = BLOCK_SPARSE_MODULES.get(getattr(cls, "__module__", ""), (None, None))
            name = getattr(cls, "__name__", "")
            if suffix and name.endswith(suffix) and not any(w in name for w in ("Vision", "Linear")):
                # the module's own path, spelled as module_path spells a node's innermost module
                found.setdefault(module_path(SimpleNamespace(meta={"nn_module_stack": {0: (path, cls)}})), reason)
    return found


class NotDSA(Exception):
    """A candidate that does not compute Hugging Face's DSA as matched; the message says why."""
