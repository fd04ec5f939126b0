"""Reading eager masks from the graph: masks built by transformers' own ``eager_mask`` become flags
exactly when they are the bottom-right causal mask (optionally with a sliding window and key
padding) of the attention they feed; every other mask stays a tensor. Either way the compiled
attention must compute what eager attention computes (fp32, relative error < 1e-5, on the rows
that have at least one key to attend).

Without a cache (``use_cache=False``, training) transformers 5.17 to 5.23 add packed-sequence terms
computed from ``position_ids`` to the mask while compiling: made in the graph from ``arange`` (no
``position_ids`` given) they provably drop out and the mask is still a flag; given as an input
(really packed sequences) the mask stays a tensor. Both are checked on the mask functions alone and
on a tiny Hugging Face Llama / Mistral, whose logits and gradients must match eager.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import masking_utils as hf_masks

from kda_compile.config import Config

from .families import build_model
from .graph_capture import GraphCapture

B, H, D = 2, 2, 8
FP32_TOL = 1e-5


def attend(q, k, v, mask):
    w = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5 + mask
    return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32), v)


def hf_mask_attention(q_offset, kv_offset, mask_function, padding=None):
    """Attention whose mask transformers' eager_mask builds inside the compiled graph."""
    def fn(q, k, v):
        mask = hf_masks.eager_mask(batch_size=q.shape[0], q_length=q.shape[2], kv_length=k.shape[2],
                                   q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                                   attention_mask=padding, dtype=q.dtype)
        return attend(q, k, v, mask)
    return fn


def run(fn, sq, sk, config=None, dynamic=False, seed=0, alive=None):
    """Compile ``fn`` with the test backend; check values on the ``alive`` rows ([B, 1, Sq] bool,
    default all: eager averages all keys of a fully masked row, the op returns 0 there)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (sq, sk, sk))
    cap = GraphCapture(config) if config is not None else GraphCapture()
    out = torch.compile(fn, backend=cap, fullgraph=True, dynamic=dynamic)(q, k, v)
    ref = fn(q, k, v)
    rows = torch.ones(B, H, sq, dtype=torch.bool) if alive is None else alive.expand(B, H, sq)
    err = float((out - ref)[rows].norm() / ref[rows].norm())
    assert torch.isfinite(out).all() and err < FP32_TOL, err
    assert cap.attention_calls() == 1 and cap.softmaxes() == 0
    rewritten = cap.reports[-1].rewritten[0]
    return rewritten.details, cap.after[-1].attention_kwargs[0]


CAUSAL = hf_masks.causal_mask_function


@pytest.mark.parametrize("sq, sk, q_offset", [(6, 6, 0), (1, 9, 8), (4, 10, 6)],
                         ids=["prefill", "decode", "chunked-prefill"])
def test_causal_mask_becomes_a_flag(sq, sk, q_offset):
    details, kwargs = run(hf_mask_attention(q_offset, 0, CAUSAL), sq, sk)
    assert kwargs["is_causal"] is True and kwargs["attn_mask"] is None and "sliding_window" not in kwargs
    assert details["mask"] == "none"


def test_sliding_window_becomes_flags():
    fn = hf_mask_attention(0, 0, hf_masks.sliding_window_causal_mask_function(3))
    details, kwargs = run(fn, 9, 9)
    assert kwargs["is_causal"] is True and kwargs["sliding_window"] == 3 and kwargs["attn_mask"] is None


def test_padding_becomes_a_key_mask_next_to_the_causal_flag():
    padding = torch.ones(B, 8, dtype=torch.bool)
    padding[0, :3] = False  # left padding of the first sequence
    alive = hf_masks.sdpa_mask(B, 8, 8, attention_mask=padding, allow_is_causal_skip=False).any(-1)
    assert not alive.all()  # the padding rows of sequence 0 have nothing to attend
    details, kwargs = run(hf_mask_attention(0, 0, CAUSAL, padding), 8, 8, alive=alive)
    assert kwargs["is_causal"] is True and kwargs["attn_mask"] is not None
    assert details["mask"].startswith("key padding")


def test_flags_hold_for_symbolic_sizes():
    # Literals inside the compiled function: Dynamo would turn closure ints into symbols, and an
    # arbitrary offset symbol is (rightly) not provably the bottom-right diagonal.
    def fn(q, k, v):
        mask = hf_masks.eager_mask(batch_size=q.shape[0], q_length=q.shape[2], kv_length=k.shape[2],
                                   mask_function=hf_masks.sliding_window_causal_mask_function(4))
        return attend(q, k, v, mask)

    details, kwargs = run(fn, 7, 7, dynamic=True)
    assert kwargs["is_causal"] is True and kwargs["sliding_window"] == 4


def test_offsets_that_are_free_symbols_are_not_proven():
    details, kwargs = run(hf_mask_attention(0, 0, CAUSAL), 7, 7, dynamic=True)
    assert kwargs.get("is_causal", False) is False
    assert "not provably the bottom-right" in details["mask"]


@pytest.mark.parametrize("name, fn, sq, sk", [
    # top-left aligned causal mask (no cache offset) with Sq < Sk: not the op's bottom-right causal
    ("top-left causal", hf_mask_attention(0, 0, CAUSAL), 4, 10),
    ("bidirectional", hf_mask_attention(0, 0, hf_masks.bidirectional_mask_function), 5, 5),
    ("chunked", hf_mask_attention(0, 0, hf_masks.chunked_causal_mask_function(
        3, torch.zeros(B, dtype=torch.long))), 8, 8),
])
def test_other_masks_stay_tensors(name, fn, sq, sk):
    details, kwargs = run(fn, sq, sk)
    assert kwargs.get("is_causal", False) is False and kwargs["attn_mask"] is not None
    assert details["mask"].startswith("tensor ("), details


@pytest.mark.parametrize("zero", ["zeros", "tensor-literal"])
def test_causal_mask_with_either_spelling_of_zero_becomes_a_flag(zero):
    # transformers 5.23 fills allowed positions from torch.zeros, 5.17 from torch.tensor(0.0, ...):
    # both are the causal mask.
    def causal(q, k, v):
        rows = torch.arange(q.shape[2])[None, None, :, None]
        cols = torch.arange(k.shape[2])[None, None, None, :]
        zeros = torch.zeros(()) if zero == "zeros" else torch.tensor(0.0, dtype=q.dtype, device=q.device)
        return attend(q, k, v, torch.where(cols <= rows, zeros, torch.finfo(q.dtype).min))

    details, kwargs = run(causal, 6, 6)
    assert kwargs["is_causal"] is True and kwargs["attn_mask"] is None, details


def test_a_nonzero_tensor_literal_is_not_a_zero_fill():
    def shifted(q, k, v):
        rows = torch.arange(q.shape[2])[None, None, :, None]
        cols = torch.arange(k.shape[2])[None, None, None, :]
        return attend(q, k, v, torch.where(cols <= rows, torch.tensor(0.5), torch.finfo(q.dtype).min))

    details, kwargs = run(shifted, 6, 6)
    assert kwargs.get("is_causal", False) is False and details["mask"].startswith("tensor ("), details


def test_strict_diagonal_is_not_causal():
    def strictly_past(q, k, v):
        rows = torch.arange(q.shape[2])[None, None, :, None]
        cols = torch.arange(k.shape[2])[None, None, None, :]
        allowed = (cols < rows) | (cols == 0)
        return attend(q, k, v, torch.where(allowed, torch.zeros(()), torch.finfo(q.dtype).min))

    details, kwargs = run(strictly_past, 6, 6)
    assert kwargs.get("is_causal", False) is False and details["mask"].startswith("tensor (")


def test_a_mask_given_as_input_stays_a_tensor():
    mask = torch.randn(B, 1, 5, 5)

    def given(q, k, v):
        return attend(q, k, v, mask)

    details, kwargs = run(given, 5, 5)
    assert kwargs["attn_mask"] is not None and details["mask"].startswith("tensor (")


def test_mask_to_flags_can_be_switched_off():
    config = Config(attention_mask_to_flags=False, compiler="aot_eager")
    details, kwargs = run(hf_mask_attention(0, 0, CAUSAL), 6, 6, config=config)
    assert kwargs.get("is_causal", False) is False and "attention_mask_to_flags is off" in details["mask"]


# ----------------------------------------------------------------------------------------------
# Packed-sequence terms (use_cache=False)
# ----------------------------------------------------------------------------------------------
PACKED = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]])  # two sequences in each row


def no_cache_mask_attention(position_ids=None, sliding_window=None, first_position=0):
    """Attention masked by what a decoder's forward builds with ``use_cache=False``: Hugging Face's
    ``create_causal_mask`` (or its sliding-window twin) given ``position_ids``, no cache, no 2-D mask.
    ``position_ids=None``: made in the graph from ``arange``, as the models do when none is given
    (``first_position`` > 0: ``torch.arange(first, first + S)``, as a ``cache_position`` is made)."""
    if sliding_window is None:
        config, make_mask = transformers.LlamaConfig(attn_implementation="eager"), hf_masks.create_causal_mask
    else:
        config = transformers.MistralConfig(attn_implementation="eager", sliding_window=sliding_window)
        make_mask = hf_masks.create_sliding_window_causal_mask

    def fn(q, k, v):
        embeds = q.transpose(1, 2).flatten(2)  # [B, S, H * D]: only its sizes and dtype are read
        positions = position_ids
        if positions is None and first_position:
            positions = torch.arange(first_position, first_position + embeds.shape[1]).unsqueeze(0)
        elif positions is None:
            positions = (torch.arange(embeds.shape[1], device=q.device) + 0).unsqueeze(0)
        mask = make_mask(config=config, inputs_embeds=embeds, attention_mask=None, past_key_values=None,
                         position_ids=positions)
        return attend(q, k, v, mask)
    return fn


# (sliding window under dynamic=True: the HF Mistral test below; here the window, a closure's
# config attribute, would itself become a symbol, rightly not provably constant)
@pytest.mark.parametrize("window, dynamic", [(None, False), (None, True), (3, False)],
                         ids=["causal", "causal-dynamic", "sliding-window"])
def test_packed_terms_of_in_graph_positions_drop_out(window, dynamic):
    details, kwargs = run(no_cache_mask_attention(sliding_window=window), 7, 7, dynamic=dynamic)
    assert kwargs["is_causal"] is True and kwargs["attn_mask"] is None, details
    assert kwargs.get("sliding_window") == window and details["mask"] == "none"


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_positions_starting_later_also_drop_out(dynamic):
    # remapped query and key positions carry the same offset: it cancels in kv - q
    details, kwargs = run(no_cache_mask_attention(first_position=3), 7, 7, dynamic=dynamic)
    assert kwargs["is_causal"] is True and kwargs["attn_mask"] is None, details


def test_given_position_ids_keep_the_mask_tensor():
    details, kwargs = run(no_cache_mask_attention(PACKED), 8, 8)
    assert kwargs.get("is_causal", False) is False and kwargs["attn_mask"] is not None
    assert details["mask"].startswith("tensor (") and "graph input" in details["mask"], details


def test_every_token_its_own_sequence_is_not_causal():
    # find_packed_sequence_indices with == instead of !=: the sequence index counts up, each
    # token attends only to itself. Same nodes as the real terms, different meaning.
    def fn(q, k, v):
        rows = torch.arange(q.shape[2]).unsqueeze(0).expand(q.shape[0], -1)
        diff = torch.diff(rows, prepend=rows[:, :1] - 1, dim=-1)
        same = hf_masks.packed_sequence_mask_function((diff == 1).cumsum(-1))
        mask = hf_masks.eager_mask(batch_size=q.shape[0], q_length=q.shape[2], kv_length=k.shape[2],
                                   mask_function=hf_masks.and_masks(CAUSAL, same))
        return attend(q, k, v, mask)

    details, kwargs = run(fn, 6, 6)
    assert kwargs.get("is_causal", False) is False and details["mask"].startswith("tensor ("), details


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all(), "NaN or inf in the compiled result"
    return float((a.double() - b.double()).norm() / b.double().norm())


def llama_ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (B, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name, window", [("llama", None), ("mistral", 5)])
def test_hf_training_forward_without_cache_uses_flags(name, window):
    model = build_model(name).train()  # attention dropout is 0: training mode changes no value
    ids = llama_ids(9)
    cap = GraphCapture()
    loss = torch.compile(model, backend=cap, fullgraph=True)(ids, labels=ids, use_cache=False).loss
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = model(ids, labels=ids, use_cache=False).loss
    ref.backward()
    assert rel_err(loss.detach(), ref.detach()) < FP32_TOL
    for n, p in model.named_parameters():
        assert rel_err(got[n], p.grad) < 1e-4, n
    (kwargs,) = cap.after[-1].attention_kwargs
    assert kwargs["is_causal"] is True and kwargs["attn_mask"] is None and kwargs.get("sliding_window") == window
    assert cap.softmaxes() == 0 and "torch.where" not in cap.after[-1].code
    assert "diff" in cap.before[-1].code  # the packed-sequence terms were there to be proven


def test_hf_packed_position_ids_keep_the_mask_and_match_eager():
    model = build_model("llama")
    ids = llama_ids(8)
    cap = GraphCapture()
    with torch.no_grad():
        out = torch.compile(model, backend=cap, fullgraph=True)(ids, position_ids=PACKED, use_cache=False).logits
        ref = model(ids, position_ids=PACKED, use_cache=False).logits
        unpacked = model(ids, use_cache=False).logits
    assert rel_err(out, ref) < FP32_TOL
    assert rel_err(unpacked, ref) > 1e-3  # the packing matters: a dropped mask would show
    (site,) = cap.reports[-1].rewritten
    assert site.details["mask"].startswith("tensor (") and "graph input" in site.details["mask"], site
    assert cap.after[-1].attention_kwargs[0]["attn_mask"] is not None


@pytest.mark.parametrize("name, window", [("llama", None), ("mistral", 5)])
def test_hf_forward_without_cache_keeps_flags_for_symbolic_lengths(name, window):
    model = build_model(name)
    cap = GraphCapture()
    compiled = torch.compile(model, backend=cap, fullgraph=True, dynamic=True)
    # float attributes as constants (as in test_hf_families.py): spares Dynamo a restart
    with torch.no_grad(), torch._dynamo.config.patch(specialize_float=True):
        for i, length in enumerate((7, 12)):
            ids = llama_ids(length, seed=i)
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                out = compiled(ids, use_cache=False).logits
            assert rel_err(out, model(ids, use_cache=False).logits) < FP32_TOL
    assert cap.graphs == 1
    (kwargs,) = cap.after[-1].attention_kwargs
    assert kwargs["is_causal"] is True and kwargs["attn_mask"] is None and kwargs.get("sliding_window") == window
