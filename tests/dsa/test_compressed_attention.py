"""``compressed_sparse_attention`` (ops/dsa/compressed): DeepSeek-V4's attention over a sliding window, compressed
entries and sinks, against its dense float64 reference on drawn shapes, against Hugging Face's own layers in a tiny
DeepSeek-V4 (prefill, a chunk and decode steps with HF's cache), through torch.compile, with gradients, and with
bad arguments named."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from kda_compile.ops.dsa.compressed import compressed_sparse_attention
from kda_compile.testing.compressed_attention_strategies import compressed_attention_inputs
from kda_compile.ops.dsa.compressed.reference import compressed_sparse_attention_reference
from kda_compile.testing import rel_error

TOL = {torch.float64: 1e-6, torch.float32: 1e-5, torch.bfloat16: 2e-2}  # lse is float32: the sink's share is too
KINDS = ("sliding", "csa", "hca", "all")  # "all": every compressed entry (HF's HCA decode step)


def inputs(kind: str, b=2, h=4, s=9, d=32, tw=12, tc=5, topk=3, dtype=torch.float64, seed=0, padding=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g).to(dtype)
    window_kv = torch.randn(b, 1, tw, d, generator=g).to(dtype)
    compressed_kv = torch.randn(b, 1, tc if kind != "sliding" else 0, d, generator=g).to(dtype)
    sinks = torch.randn(h, generator=g).to(dtype)
    kwargs = {}
    if kind == "csa":
        picks = torch.stack([torch.randperm(tc, generator=g)[:topk] for _ in range(b * s)]).view(b, s, topk)
        picks[0, 0, -1] = -1  # an indexer pick the query may not see
        kwargs["selected"] = picks.to(torch.int32)
    elif kind == "hca":
        kwargs.update(compress_rate=2, query_positions=torch.arange(tw - s, tw).expand(b, s))
    if padding:
        mask = torch.ones(b, tw, dtype=torch.bool)
        mask[0, :4] = False  # a left-padded row
        kwargs["key_padding_mask"] = mask
    return (q, window_kv, compressed_kv, sinks), dict(scale=d ** -0.5, sliding_window=4, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("s, tw", [(9, 12), (1, 12), (12, 12)], ids=["chunk", "decode", "prefill"])
def test_against_the_dense_reference(kind, padding, dtype, s, tw):
    args, kwargs = inputs(kind, s=s, tw=tw, dtype=dtype, padding=padding)
    got = compressed_sparse_attention(*args, **kwargs)
    want = compressed_sparse_attention_reference(*(a.double() for a in args), **kwargs)
    assert got.dtype == dtype and got.shape == args[0].shape and not got.isnan().any()
    assert got.transpose(1, 2).is_contiguous()  # stored [B, S, H, D]: what feeds o_proj
    assert rel_error(got, want) < TOL[dtype]


@settings(deadline=None)
@given(args=compressed_attention_inputs(dtypes=(torch.float32, torch.float64)))
def test_drawn_calls_equal_the_reference(args):
    """Windows wider and narrower than the keys, no compressed entry, picks with holes, left padding."""
    got = compressed_sparse_attention(**args)
    tensors = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
               for k, v in args.items()}
    want = compressed_sparse_attention_reference(**tensors)
    assert not got.isnan().any() and rel_error(got, want) < TOL[args["query"].dtype]


def test_a_query_that_sees_nothing_gives_zero():
    """Every window key padded and no compressed entry: the whole weight is the sink's."""
    args, kwargs = inputs("sliding", b=1, s=3, tw=3)
    kwargs["key_padding_mask"] = torch.zeros(1, 3, dtype=torch.bool)
    assert torch.equal(compressed_sparse_attention(*args, **kwargs), torch.zeros_like(args[0]))


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_equal_the_references(kind, padding):
    """Gradients w.r.t. the query, both key tensors and the sinks, against autograd through the dense float64
    reference (a finite-difference check would see the float32 log-sum-exp's rounding instead)."""
    args, kwargs = inputs(kind, padding=padding)
    weight = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = []
    for fn in (compressed_sparse_attention, compressed_sparse_attention_reference):
        leaves = tuple(a.detach().clone().requires_grad_() for a in args)
        (fn(*leaves, **kwargs) * weight).sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    for name, have, want in zip(("query", "window_kv", "compressed_kv", "sinks"), *grads):
        if want.numel():
            assert rel_error(have, want) < 1e-6, name


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_without_graph_breaks(kind):
    args, kwargs = inputs(kind)
    compiled = torch.compile(compressed_sparse_attention, fullgraph=True, dynamic=True, backend="aot_eager")
    assert rel_error(compiled(*args, **kwargs), compressed_sparse_attention(*args, **kwargs)) < 1e-12


# ----------------------------------------------------------------------------------------------
# Against Hugging Face's DeepSeek-V4 layers
# ----------------------------------------------------------------------------------------------
hf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from tests.dsa.test_deepseek_v4_on_sparse_attention import LAYER_TYPES, RATES, tiny_model  # noqa: E402


def recorded_layers(model, monkeypatch):
    """Per layer and call: HF's attention inputs and output, the compressor's entry count and positions, and the
    CSA indexer's picks."""
    calls, entries, picks = {}, {}, {}
    eager = hf.eager_attention_forward

    def recording(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        out, weights = eager(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        calls[module.layer_idx] = dict(q=query, kv=key, out=out, sinks=module.sinks, scale=scaling)
        return out, weights

    monkeypatch.setattr(hf, "eager_attention_forward", recording)
    for index, layer in enumerate(model.model.layers):
        compressor = layer.self_attn.compressor
        if compressor is None:
            continue
        compressor.register_forward_hook(
            lambda m, a, out, index=index: entries.__setitem__(index, (out[0].shape[2], a[2])))
        if hasattr(compressor, "indexer"):
            compressor.indexer.register_forward_hook(lambda m, a, out, index=index: picks.__setitem__(index, out))
    return calls, entries, picks


def test_each_layer_kind_gives_hf_output_in_prefill_chunk_and_decode(monkeypatch):
    """A 20-token prefill, a 5-token chunk and three decode steps into HF's own cache: at every call each layer's
    attention output equals HF's (fp32, relative error below 1e-5), the window keys being what HF's sliding cache
    handed back and the compressed entries what its compressor did."""
    model = tiny_model()
    calls, entries, picks = recorded_layers(model, monkeypatch)
    ids = torch.randint(0, 64, (1, 28), generator=torch.Generator().manual_seed(1))
    cache, checked = None, 0
    with torch.no_grad():
        for chunk in (ids[:, :20], ids[:, 20:25], ids[:, 25:26], ids[:, 26:27], ids[:, 27:28]):
            calls.clear(), entries.clear(), picks.clear()
            cache = model(input_ids=chunk, past_key_values=cache, use_cache=True).past_key_values
            for layer, kind in enumerate(LAYER_TYPES):
                c = calls[layer]
                tc, positions = entries.get(layer, (0, None))
                tw = c["kv"].shape[2] - tc
                kwargs = {}
                if kind == "compressed_sparse_attention":
                    kwargs["selected"] = picks[layer]
                elif kind == "heavily_compressed_attention":
                    kwargs.update(compress_rate=RATES[kind], query_positions=positions)
                got = compressed_sparse_attention(c["q"], c["kv"][:, :, :tw], c["kv"][:, :, tw:], c["sinks"],
                                                  scale=c["scale"], sliding_window=model.config.sliding_window,
                                                  **kwargs)
                assert rel_error(got.transpose(1, 2), c["out"]) < 1e-5, (kind, chunk.shape, tw, tc)
                checked += 1
    assert checked == 15


# ----------------------------------------------------------------------------------------------
# Bad arguments
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, error, message", [
    (lambda a, k: (a[0][0], a[1:], k), ValueError, r"query .*a 4-D tensor"),
    (lambda a, k: ((a[0], a[1].float(), *a[2:]), (), k), TypeError, r"window_kv .*of query's dtype"),
    (lambda a, k: ((a[0], a[1][:, :, :5], *a[2:]), (), k), ValueError, r"window_kv .*Tw >= S = 9"),
    (lambda a, k: ((a[0], a[1].expand(2, 2, 12, 32), *a[2:]), (), k), ValueError, r"window_kv .*one key head"),
    (lambda a, k: ((*a[:3], a[3][:2]), (), k), ValueError, r"sinks .*\[H\] = \[4\]"),
    (lambda a, k: (a, (), {**k, "scale": 0.0}), ValueError, r"scale .*a finite float > 0"),
    (lambda a, k: (a, (), {**k, "sliding_window": 0}), ValueError, r"sliding_window .*an int >= 1"),
    (lambda a, k: (a, (), {**k, "sliding_window": 2.0}), TypeError, r"sliding_window .*an int >= 1"),
    (lambda a, k: (a, (), {**k, "selected": k["selected"].float()}), TypeError, r"selected .*of dtype int32, int64"),
    (lambda a, k: (a, (), {**k, "selected": k["selected"] + 4}), ValueError,
     r"selected must be -1 \(none\) or compressed entries in \[0, Tc\) = \[0, 5\), got 7 at selected\[0, 0, 0\]"),
    (lambda a, k: (a, (), {"scale": 0.1, "sliding_window": 4, "compress_rate": 2}), TypeError,
     r"query_positions .*given exactly when compress_rate"),
    (lambda a, k: (a, (), {**k, "key_padding_mask": torch.ones(2, 5, dtype=torch.bool)}), ValueError,
     r"key_padding_mask .*\[B, Tw\] = \[2, 12\]"),
], ids=["query-rank", "dtype", "short-window", "kv-heads", "sinks", "scale", "window", "window-type",
        "selected-dtype", "selected-range", "rate-without-positions", "padding-shape"])
def test_bad_arguments_are_named(change, error, message):
    args, kwargs = inputs("csa")
    args, extra, kwargs = change(args, kwargs)
    args = (args,) + tuple(extra) if isinstance(args, torch.Tensor) else args
    with pytest.raises(error, match=message):
        compressed_sparse_attention(*args, **kwargs)


def test_csa_and_hca_arguments_are_exclusive():
    args, kwargs = inputs("csa")
    with pytest.raises(ValueError, match=r"selected .*None when compress_rate is given"):
        compressed_sparse_attention(*args, **kwargs, compress_rate=2, query_positions=torch.zeros(2, 9).long())


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_at_deepseek_v4_widths(kind):
    """64 heads over one 512-wide key/value head, a 128-token window, 64 picks per query (CSA) or every closed
    entry of rate 8 (HCA), bf16 on CUDA against the float64 reference."""
    args, kwargs = inputs(kind, b=1, h=64, s=256, d=512, tw=384, tc=48, topk=32, dtype=torch.bfloat16)
    kwargs["sliding_window"] = 128
    if kind == "hca":
        kwargs["compress_rate"] = 8
    cuda = tuple(a.cuda() for a in args)
    kwargs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    got = compressed_sparse_attention(*cuda, **kwargs)
    want = compressed_sparse_attention_reference(*(a.double() for a in cuda), **kwargs)
    assert not got.isnan().any() and rel_error(got, want) < TOL[torch.bfloat16]


def test_the_selection_op_passes_opcheck():
    from kda_compile.ops.dsa.compressed.custom_ops import compressed_selected_keys

    picks = torch.tensor([[[0, -1, 2], [3, 1, -1]]], dtype=torch.int64)
    assert torch.equal(compressed_selected_keys(picks, 5, 4), torch.tensor([[[5, -1, 7], [8, 6, -1]]],
                                                                          dtype=torch.int32))
    torch.library.opcheck(torch.ops.kda_compile.compressed_selected_keys.default, (picks, 5, 4))
    torch.library.opcheck(torch.ops.kda_compile.compressed_selected_keys.default, (picks.int().transpose(1, 2), 0, 4))
