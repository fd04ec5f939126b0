"""The patterns of eager softmax attention, as Hugging Face's ``eager_attention_forward`` and the spellings
softmax.py describes write it: the score product (:data:`SCORES`), the optional stages from the softmax input
up to it (:data:`ALL_SCORE_STAGES`) and from the softmax output down to the value product
(:data:`ALL_PROBABILITY_STAGES`, :data:`OUTPUT`). softmax.py matches all of them; the rewrites that build their
calls without its graph edits (mla/absorb.py, dsa/sparse.py) match :data:`SCORE_STAGES` /
:data:`PROBABILITY_STAGES`; lse_softmax.py reads them to say what stops an ``exp(x - logsumexp(x))`` softmax.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from kda_compile.ops.attention import attention
from kda_compile.passes.attention.spellings import CLAMP_MIN, MASKED_FILL, MAXIMUM, clamp_bound, fill_value, is_zero
from kda_compile.passes.toolkit.graph_tools import is_last_dim, is_tensor_node, tensor_of
from kda_compile.passes.toolkit.matching import (ADD, CAST, CAT, DIV, DROPOUT, EXPAND, GETITEM, LINK, MATMUL, MAX, MUL,
                                                 RESHAPE, SUB, TANH, TRANSPOSE, Call, Capture, Const, OneOf, Seq, Stage,
                                                 cast_dtype, family)


# ``kda_compile.ops.attention`` as the attention rewrites insert it, for the rewrites that run after them
ATTENTION = family("attention", ("query", "key", "value"), functions=(attention,), defaults={
    "attn_mask": None, "is_causal": False, "scale": None, "softcap": None, "sinks": None, "dropout_p": 0.0,
    "sliding_window": None})


def _swaps_last_two(node: torch.fx.Node) -> bool:
    b = TRANSPOSE.bind(node)
    x = tensor_of(b["input"]) if b is not None else None
    n = x.dim() if x is not None and x.dim() >= 4 else 4
    return b is not None and {b["dim0"] % n if isinstance(b["dim0"], int) else None,
                              b["dim1"] % n if isinstance(b["dim1"], int) else None} == {n - 2, n - 1}


def _is_last_dim_4d(dim: Any) -> bool:
    return is_last_dim(dim, 4)


def _drops_last_column(index: Any) -> bool:
    return index == (Ellipsis, slice(None, -1, None))


def _is_probability(p: Any) -> bool:
    return isinstance(p, (int, float)) and not isinstance(p, bool) and 0.0 <= p < 1.0


LAST_DIM = Const(where=_is_last_dim_4d)
LINKED = Capture(LINK)
CLAMP_BOUND = Capture("clamp", lambda v: clamp_bound(v) is not None)

# In-place spellings of the score chain (``scores /= divisor``, ``scores *= scale``). They mutate a
# node of the chain itself (fresh tensors from q @ k^T on), which check_site proves has no other user.
IN_PLACE_MUL = family("imul", ("input", "other"), functions=(operator.imul,), methods=("mul_",))
IN_PLACE_DIV = family("itruediv", ("input", "other"), functions=(operator.itruediv,), methods=("div_",))
WHERE = family("where", ("condition", "input", "other"), functions=(torch.where,))


def _upcasts(node: torch.fx.Node) -> bool:
    """A cast of half / bf16 / fp32 scores to fp32: neutral, since the op's softmax runs in fp32."""
    source = tensor_of(CAST.bind(node)["input"])
    return (cast_dtype(node) == torch.float32 and source is not None
            and source.dtype in (torch.float16, torch.bfloat16, torch.float32))


def _is_fill(fill: Any) -> bool:
    """What ``torch.where(keep, scores, fill)`` writes: a float, or ``torch.tensor(float)``."""
    return fill_value(fill) is not None and not (isinstance(fill, int) or (
        isinstance(fill, torch.fx.Node) and isinstance(fill.args[0], int)))

# From the softmax input up to the scores, each stage optional, in the order HF applies them.
ALL_SCORE_STAGES = (
    Stage("upcast", Call(CAST, input=LINKED, where=_upcasts), repeat=True),
    Stage("sink_shift", Call(SUB, input=LINKED, other=Call(GETITEM, index=0, input=Call(
        MAX, input=LINKED, dim=LAST_DIM, keepdim=True)))),
    Stage("sinks", Call(CAT, dim=LAST_DIM, tensors=Seq(LINKED, Call(
        EXPAND, look_through=True, name="sink_column", input=Call(
            RESHAPE, look_through=True, name="sink_view", input=Capture("sinks", is_tensor_node)))))),
    # inkling2: a sink logit per query, an extra [B, H, Sq, 1] column (attention/spellings.py).
    Stage("query_sinks", Call(CAT, dim=LAST_DIM, tensors=Seq(LINKED, Capture("query_sinks", is_tensor_node)))),
    # xlnet: scores - 1e30 * mask (after its scale), a float mask subtracted (attention/spellings.py).
    Stage("subtracted_mask", Call(SUB, name="mask_subtracted_scores", input=LINKED,
                                  other=Capture("subtracted", is_tensor_node))),
    # codegen: (scores + mask) / scale, the scale after the mask (it then scales the mask too).
    Stage("scale_after_mask", OneOf(Call(MUL, commutative=True, input=LINKED, other=Const("post_scale")),
                                    Call(DIV, input=LINKED, other=Const("post_scale_divisor")))),
    # xlnet: (content + position + 0) * scale, the segment term a literal 0 without segment ids.
    Stage("plus_zero", Call(ADD, commutative=True, input=LINKED, other=Const(where=lambda v: is_zero(v)))),
    # xglm: torch.max(scores + mask, finfo.min), neutral for the softmax (attention/spellings.py).
    Stage("clamp", OneOf(Call(MAXIMUM, commutative=True, name="clamped_scores", input=LINKED, other=CLAMP_BOUND),
                         Call(CLAMP_MIN, name="clamped_scores", input=LINKED, min=CLAMP_BOUND, max=None))),
    # cpmant: masked_fill(scores, drop, -inf), a bool mask (True = masked).
    Stage("fill_mask", Call(MASKED_FILL, name="filled_scores", input=LINKED, mask=Capture("drop", is_tensor_node),
                            value=Capture("fill", lambda v: fill_value(v) is not None))),
    Stage("mask", Call(ADD, name="masked_scores", commutative=True, input=LINKED,
                       other=Capture("mask", is_tensor_node))),
    # bloom's ALiBi (see attention/spellings.py): a second additive float term, passed to the op as
    # (part of) its float attn_mask.
    Stage("bias", Call(ADD, name="biased_scores", commutative=True, input=LINKED,
                       other=Capture("bias", is_tensor_node))),
    # gpt_neo: torch.where(causal_bool, scores, finfo.min), a bool mask (True = attend).
    Stage("where_mask", Call(WHERE, name="kept_scores", input=LINKED, condition=Capture("keep", is_tensor_node),
                             other=Capture("fill", _is_fill))),
    # openai-gpt: scores * b + -1e4 * (1 - b), b a 0/1 buffer slice (attention/spellings.py).
    Stage("mult_mask", Call(ADD, commutative=True, name="mult_masked_scores", input=Call(
        MUL, commutative=True, input=LINKED, other=Capture("keep_factor", is_tensor_node)), other=Call(
        MUL, commutative=True, input=Const("mult_fill"), other=Call(
            SUB, input=Const(where=lambda v: v == 1), other=Capture("keep_factor", is_tensor_node))))),
    Stage("softcap", Call(MUL, commutative=True, other=Const("softcap", symbolic=True), input=Call(
        TANH, input=Call(DIV, input=LINKED, other=Const("softcap", symbolic=True))))),
    Stage("scale", OneOf(Call(MUL, commutative=True, input=LINKED, other=Const("scale", symbolic=True)),
                         Call(IN_PLACE_MUL, input=LINKED, other=Const("scale", symbolic=True)),
                         Call(DIV, input=LINKED, other=Const("scale_divisor", symbolic=True)),
                         Call(IN_PLACE_DIV, input=LINKED, other=Const("scale_divisor", symbolic=True)))),
)
# Stages whose mask handling needs the graph edits of _replace (_scaled_mask, _with_bias, the ~drop
# mask): matched by this rewrite only. mla/absorb.py and dsa/sparse.py build their calls from
# SCORE_STAGES / PROBABILITY_STAGES and attention_arguments, so they see the sites without them.
GRAPH_EDIT_STAGES = frozenset({"scale_after_mask", "fill_mask", "bias", "zero_masked", "clamp", "query_sinks",
                               "subtracted_mask", "plus_zero", "mult_mask"})
SCORE_STAGES = tuple(s for s in ALL_SCORE_STAGES if s.name not in GRAPH_EDIT_STAGES)
SCORES = Call(MATMUL, name="scores", input=Capture("query", is_tensor_node), other=Call(
    TRANSPOSE, look_through=True, where=_swaps_last_two, input=Capture("key_states", is_tensor_node)))

# From the softmax output down to the value product, through single-user nodes.
PURE_CAST = Call(CAST, input=LINKED, where=lambda n: cast_dtype(n) is not None)
ALL_PROBABILITY_STAGES = (
    # cpmant: masked_fill(probabilities, drop, 0) with the condition of the fill_mask stage.
    Stage("zero_masked", Call(MASKED_FILL, input=LINKED, mask=Capture("zeroed", is_tensor_node),
                              value=Capture("zero", lambda v: fill_value(v) == 0.0))),
    Stage("drop_sink_column", Call(GETITEM, input=LINKED, index=Const(where=_drops_last_column))),
    Stage("cast", PURE_CAST, repeat=True),
    Stage("dropout", Call(DROPOUT, input=LINKED, inplace=False, p=Const("dropout_p", where=_is_probability),
                          training=Const("training", where=lambda t: isinstance(t, bool)))),
    Stage("cast_after_dropout", PURE_CAST, repeat=True),
)
PROBABILITY_STAGES = tuple(s for s in ALL_PROBABILITY_STAGES if s.name not in GRAPH_EDIT_STAGES)
OUTPUT = Call(MATMUL, name="output", input=LINKED, other=Capture("value_states", is_tensor_node))
