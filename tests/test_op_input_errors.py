"""Bad input to every public op (docs/op-input-errors.md): the same ValueError / TypeError eagerly and under
``torch.compile(fullgraph=True)``, naming the argument, its value and what is accepted; the DSA index values;
empty sequences; float64 in the DSA indexer. CPU only."""
from __future__ import annotations

import math

import pytest
import torch

import kda_compile.ops as ops
from kda_compile.ops.dsa import custom_ops as dsa_custom_ops
from kda_compile.ops.dsa.reference import indexer_topk_reference


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=_randn.gen, dtype=dtype)


_randn.gen = torch.Generator().manual_seed(0)


# ----------------------------------------------------------------------------------------------
# Good arguments of each public op (keywords only, so a case replaces one by name)
# ----------------------------------------------------------------------------------------------
def _attention():
    return dict(query=_randn(1, 2, 3, 8), key=_randn(1, 1, 4, 8), value=_randn(1, 1, 4, 6))


def _mla():
    return dict(q_nope=_randn(1, 2, 3, 8), q_rope=_randn(1, 2, 3, 4), kv_latent=_randn(1, 5, 16),
                k_rope=_randn(1, 5, 4), kv_b_weight=_randn(2 * (8 + 6), 16), scale=0.3)


def _indexer():
    return dict(q=_randn(1, 4, 2, 8), k=_randn(1, 6, 8), weights=_randn(1, 4, 2), topk=3)


def _pooled():
    return dict(q=_randn(1, 4, 2, 8), k=_randn(1, 6, 8), weights=_randn(1, 4, 2), gate=_randn(1, 6, 8),
                ape=_randn(2, 8), topk=4, scale=0.5)


def _sparse():
    indices = torch.tensor([[[0, -1], [1, 2], [7, 3]]], dtype=torch.int32)
    return dict(q=_randn(1, 3, 4, 12), k=_randn(1, 8, 1, 12), v=None, indices=indices, d_v=8)


def _delta_rule(per_head_gate: bool):
    def make():
        g_shape = (1, 5, 2) if per_head_gate else (1, 5, 2, 8)
        return dict(q=_randn(1, 5, 2, 8), k=_randn(1, 5, 2, 8), v=_randn(1, 5, 2, 8),
                    g=-torch.rand(*g_shape, generator=_randn.gen), beta=torch.rand(1, 5, 2, generator=_randn.gen))
    return make


def _experts():
    return dict(hidden_states=_randn(3, 8), top_k_index=torch.tensor([[0, 1], [2, 0], [1, 1]]),
                top_k_weights=_randn(3, 2), gate_up_proj=_randn(3, 12, 8), down_proj=_randn(3, 8, 6))


def _block_sparse():
    return dict(query=_randn(1, 4, 3, 8), key=_randn(1, 2, 10, 8), value=_randn(1, 2, 10, 6),
                block_indices=torch.tensor([[[[0, -1], [1, 0], [2, 1]]] * 2]), block_size=4)


def _compressed():
    return dict(query=_randn(1, 2, 3, 8), window_kv=_randn(1, 1, 5, 8), compressed_kv=_randn(1, 1, 4, 8),
                sinks=_randn(2), scale=0.3, sliding_window=3,
                selected=torch.tensor([[[0, -1], [1, 2], [3, 0]]], dtype=torch.int32))


def _conv_update():
    return dict(x=_randn(2, 6, 1), conv_state=_randn(2, 6, 4), weight=_randn(6, 4), bias=_randn(6), activation="silu")


OPS = {  # public op name -> (function, good arguments)
    "attention": (ops.attention, _attention),
    "attention_with_lse": (ops.attention_with_lse, _attention),
    "mla_attention": (ops.mla_attention, _mla),
    "dsa_indexer_topk": (ops.dsa_indexer_topk, _indexer),
    "dsa_pooled_indexer_topk": (ops.dsa_pooled_indexer_topk, _pooled),
    "dsa_sparse_attention": (ops.dsa_sparse_attention, _sparse),
    "chunk_kda": (ops.chunk_kda, _delta_rule(False)),
    "fused_recurrent_kda": (ops.fused_recurrent_kda, _delta_rule(False)),
    "chunk_gated_delta_rule": (ops.chunk_gated_delta_rule, _delta_rule(True)),
    "fused_recurrent_gated_delta_rule": (ops.fused_recurrent_gated_delta_rule, _delta_rule(True)),
    "moe_experts": (ops.moe_experts, _experts),
    "causal_conv1d_update": (ops.causal_conv1d_update, _conv_update),
    "block_sparse_attention": (ops.block_sparse_attention, _block_sparse),
    "compressed_sparse_attention": (ops.compressed_sparse_attention, _compressed),
}
NOT_OPS = {"CPContext", "build_cp_context"}  # context-parallel set-up, no tensor op
ALIASES = {"chunk_gdn": "chunk_gated_delta_rule", "fused_recurrent_gdn": "fused_recurrent_gated_delta_rule"}

_ATTENTION_CASES = [
    # (case, change to the good arguments, exception, the argument the message names)
    ("window-zero", lambda a: dict(a, is_causal=True, sliding_window=0), ValueError, "sliding_window"),
    ("key-dtype", lambda a: dict(a, key=a["key"].double()), TypeError, "key"),
    ("mask-shape", lambda a: dict(a, attn_mask=torch.ones(5, 5, dtype=torch.bool)), ValueError, "attn_mask"),
    ("sinks-int", lambda a: dict(a, sinks=torch.zeros(2, dtype=torch.long)), TypeError, "sinks"),
    ("query-none", lambda a: dict(a, query=None), TypeError, "query"),
    ("head-dim-zero", lambda a: dict(a, query=a["query"][..., :0], key=a["key"][..., :0]), ValueError, "query"),
    ("heads-not-dividing", lambda a: dict(a, query=_randn(1, 3, 3, 8), key=_randn(1, 2, 4, 8),
                                          value=_randn(1, 2, 4, 6)), ValueError, "key"),
    ("value-length", lambda a: dict(a, value=a["value"][:, :, :3]), ValueError, "value"),
]
_DELTA_RULE_CASES = [
    ("scale-nan", lambda a: dict(a, scale=math.nan), ValueError, "scale"),
    ("k-dtype", lambda a: dict(a, k=a["k"].double()), TypeError, "k"),
    ("v-heads-zero", lambda a: dict(a, v=a["v"][:, :, :0]), ValueError, "v"),
]
_DECODE_CASES = _DELTA_RULE_CASES + [  # inplace_final_state: decode writes its final state over initial_state
    ("inplace-without-state", lambda a: dict(a, inplace_final_state=True), ValueError, "initial_state"),
    ("inplace-with-gradients", lambda a: dict(a, q=a["q"].requires_grad_(), initial_state=torch.zeros(1, 2, 8, 8),
                                              inplace_final_state=True), ValueError, "inplace_final_state"),
]
CASES = {
    "attention": _ATTENTION_CASES,
    "attention_with_lse": _ATTENTION_CASES,
    "mla_attention": [
        ("scale-zero", lambda a: dict(a, scale=0.0), ValueError, "scale"),
        ("q_rope-shape", lambda a: dict(a, q_rope=a["q_rope"][:, :, :2]), ValueError, "q_rope"),
        ("path", lambda a: dict(a, path="fast"), ValueError, "path"),
        ("weight-dtype", lambda a: dict(a, kv_b_weight=a["kv_b_weight"].double()), TypeError, "kv_b_weight"),
        ("mask-shape", lambda a: dict(a, attn_mask=torch.ones(2, 2, dtype=torch.bool)), ValueError, "attn_mask"),
        ("k_rope-length", lambda a: dict(a, k_rope=a["k_rope"][:, :4]), ValueError, "k_rope"),
        ("weight-rows", lambda a: dict(a, kv_b_weight=a["kv_b_weight"][:27]), ValueError, "kv_b_weight"),
    ],
    "dsa_indexer_topk": [
        ("topk-zero", lambda a: dict(a, topk=0), ValueError, "topk"),
        ("topk-float", lambda a: dict(a, topk=2.0), TypeError, "topk"),
        ("weights-shape", lambda a: dict(a, weights=a["weights"][:, :3]), ValueError, "weights"),
        ("key_mask-dtype", lambda a: dict(a, key_mask=torch.ones(1, 6)), TypeError, "key_mask"),
        ("q-int", lambda a: dict(a, q=a["q"].int()), TypeError, "q"),
        ("k-width", lambda a: dict(a, k=a["k"][..., :5]), ValueError, "k"),
        ("cu_seqlens-unpacked", lambda a: dict(a, cu_seqlens=torch.tensor([0, 6], dtype=torch.int32)), ValueError,
         "cu_seqlens"),
    ],
    "dsa_pooled_indexer_topk": [
        ("ape-width", lambda a: dict(a, ape=a["ape"][:, :7]), ValueError, "ape"),
        ("select_tail-int", lambda a: dict(a, select_tail=1), TypeError, "select_tail"),
        ("k-dtype", lambda a: dict(a, k=a["k"].double()), TypeError, "k"),
        ("gate-length", lambda a: dict(a, gate=a["gate"][:, :5]), ValueError, "gate"),
        ("q_offset-float", lambda a: dict(a, q_offset=2.5), TypeError, "q_offset"),
    ],
    "dsa_sparse_attention": [
        ("d_v-too-wide", lambda a: dict(a, d_v=13), ValueError, "d_v"),
        ("indices-int64", lambda a: dict(a, indices=a["indices"].long()), TypeError, "indices"),
        ("indices-shape", lambda a: dict(a, indices=a["indices"][:, :2]), ValueError, "indices"),
        ("k-heads", lambda a: dict(a, k=_randn(1, 8, 3, 12)), ValueError, "k"),
        ("v-length", lambda a: dict(a, v=_randn(1, 7, 1, 8), d_v=None), ValueError, "v"),
        ("scale-inf", lambda a: dict(a, scale=math.inf), ValueError, "scale"),
    ],
    "chunk_kda": _DELTA_RULE_CASES,
    "fused_recurrent_kda": _DECODE_CASES,
    "chunk_gated_delta_rule": _DELTA_RULE_CASES,
    "fused_recurrent_gated_delta_rule": _DECODE_CASES,
    "moe_experts": [
        ("kernel", lambda a: dict(a, kernel="cutlass"), ValueError, "kernel"),
        ("index-float", lambda a: dict(a, top_k_index=a["top_k_index"].float()), TypeError, "top_k_index"),
        ("weights-slots", lambda a: dict(a, top_k_weights=a["top_k_weights"][:, :1]), ValueError, "top_k_weights"),
        ("gate_up-width", lambda a: dict(a, gate_up_proj=a["gate_up_proj"][..., :5]), ValueError, "gate_up_proj"),
        ("down-dtype", lambda a: dict(a, down_proj=a["down_proj"].double()), TypeError, "down_proj"),
        ("hidden-rank", lambda a: dict(a, hidden_states=a["hidden_states"][0]), ValueError, "hidden_states"),
    ],
    "causal_conv1d_update": [
        ("kernel", lambda a: dict(a, kernel="cuda"), ValueError, "kernel"),
        ("activation", lambda a: dict(a, activation="gelu"), ValueError, "activation"),
        ("x-rank", lambda a: dict(a, x=a["x"][0]), ValueError, "x"),
        ("state-short", lambda a: dict(a, conv_state=a["conv_state"][..., :2]), ValueError, "conv_state"),
        ("weight-channels", lambda a: dict(a, weight=a["weight"][:5]), ValueError, "weight"),
        ("bias-dtype", lambda a: dict(a, bias=a["bias"].double()), ValueError, "bias"),
        ("state-int", lambda a: dict(a, conv_state=a["conv_state"].int()), TypeError, "conv_state"),
    ],
    "block_sparse_attention": [
        ("block_size-zero", lambda a: dict(a, block_size=0), ValueError, "block_size"),
        ("block_size-float", lambda a: dict(a, block_size=4.0), TypeError, "block_size"),
        ("indices-float", lambda a: dict(a, block_indices=a["block_indices"].float()), TypeError, "block_indices"),
        ("indices-groups", lambda a: dict(a, block_indices=a["block_indices"][:, :1]), ValueError, "block_indices"),
        ("key-groups", lambda a: dict(a, key=_randn(1, 3, 10, 8), value=_randn(1, 3, 10, 6)), ValueError, "key"),
        ("value-dtype", lambda a: dict(a, value=a["value"].double()), TypeError, "value"),
        ("positions-shape", lambda a: dict(a, query_positions=torch.zeros(1, 2, dtype=torch.long)), ValueError,
         "query_positions"),
        ("padding-dtype", lambda a: dict(a, key_padding_mask=torch.ones(1, 10)), TypeError, "key_padding_mask"),
        ("scale-nan", lambda a: dict(a, scale=math.nan), ValueError, "scale"),
    ],
    "compressed_sparse_attention": [
        ("window-zero", lambda a: dict(a, sliding_window=0), ValueError, "sliding_window"),
        ("window-float", lambda a: dict(a, sliding_window=3.0), TypeError, "sliding_window"),
        ("kv-dtype", lambda a: dict(a, window_kv=a["window_kv"].double()), TypeError, "window_kv"),
        ("window-short", lambda a: dict(a, window_kv=a["window_kv"][:, :, :2]), ValueError, "window_kv"),
        ("compressed-width", lambda a: dict(a, compressed_kv=a["compressed_kv"][..., :7]), ValueError,
         "compressed_kv"),
        ("sinks-heads", lambda a: dict(a, sinks=a["sinks"][:1]), ValueError, "sinks"),
        ("selected-float", lambda a: dict(a, selected=a["selected"].float()), TypeError, "selected"),
        ("selected-range", lambda a: dict(a, selected=a["selected"] + 3), ValueError, "selected"),
        ("both-kinds", lambda a: dict(a, compress_rate=2, query_positions=torch.zeros(1, 3, dtype=torch.long)),
         ValueError, "selected"),
        ("scale-nan", lambda a: dict(a, scale=math.nan), ValueError, "scale"),
        ("padding-dtype", lambda a: dict(a, key_padding_mask=torch.ones(1, 5)), TypeError, "key_padding_mask"),
    ],
}
PARAMS = [pytest.param(op, *case[1:], id=f"{op}-{case[0]}") for op, cases in CASES.items() for case in cases]


def _raised(call):
    """(type, first line) of what ``call()`` raises; an AssertionError when it raises nothing."""
    try:
        call()
    except Exception as error:  # noqa: BLE001  (the test compares whatever comes out)
        return type(error), str(error).splitlines()[0]
    raise AssertionError("nothing was raised")


def _compiled(fn, dynamic: bool, backend: str = "aot_eager"):
    torch._dynamo.reset()
    return torch.compile(lambda kw: fn(**kw), backend=backend, fullgraph=True, dynamic=dynamic)


def test_every_public_op_has_cases():
    # A new public op must come with its bad-input cases here (and a row in docs/op-input-errors.md).
    public = set(ops.__all__) - NOT_OPS - set(ALIASES)
    assert public == set(OPS) == set(CASES)
    for alias, name in ALIASES.items():
        assert getattr(ops, alias) is OPS[name][0]


@pytest.mark.parametrize("op,change,kind,name", PARAMS)
def test_eager_error_names_argument_value_and_accepted(op, change, kind, name):
    fn, good = OPS[op]
    raised, line = _raised(lambda: fn(**change(good())))
    assert raised is kind, line
    assert line.startswith(f"{name} must be "), line  # "<argument> must be <accepted>, got <value>"
    assert ", got " in line, line


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("op,change,kind,name", PARAMS)
def test_compiled_error_is_the_eager_one(op, change, kind, name, dynamic):
    fn, good = OPS[op]
    args = change(good())
    eager = _raised(lambda: fn(**args))
    try:
        assert _raised(lambda: _compiled(fn, dynamic)(args)) == eager
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("op", ["attention", "dsa_sparse_attention", "mla_attention"])
def test_compiled_error_with_the_caller_using_the_outputs(op):
    # The placeholders have the outputs' shapes and layout, so code after the call traces on to the error.
    fn, good = OPS[op]
    bad = dict(CASES[op][0][1](good()))

    def caller(kw):
        out = fn(**kw)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1).sum()

    eager = _raised(lambda: caller(bad))
    torch._dynamo.reset()
    try:
        assert _raised(lambda: torch.compile(caller, backend="aot_eager", fullgraph=True)(bad)) == eager
    finally:
        torch._dynamo.reset()


def test_compiled_good_call_after_a_bad_one_runs():
    # The bad call's graph is guarded on its arguments: a good call compiles anew and returns the eager result.
    fn, good = OPS["attention"]
    args = good()
    compiled = _compiled(fn, False)
    with pytest.raises(ValueError, match="sliding_window"):
        compiled(dict(args, is_causal=True, sliding_window=0))
    torch.testing.assert_close(compiled(dict(args, is_causal=True, sliding_window=2)),
                               fn(**args, is_causal=True, sliding_window=2))
    torch._dynamo.reset()


def test_inductor_keeps_the_error():
    # Inductor drops an op whose outputs are unused or empty unless it is marked side-effecting.
    fn, good = OPS["dsa_indexer_topk"]
    torch._dynamo.reset()
    compiled = torch.compile(lambda kw: (fn(**kw), 1)[1], fullgraph=True)
    try:
        with pytest.raises(ValueError, match="topk must be an int >= 1, got 0"):
            compiled(dict(good(), topk=0))
    finally:
        torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------
# DSA: index values
# ----------------------------------------------------------------------------------------------
def _with_index(value):
    args = _sparse()
    indices = args["indices"].clone()
    indices[0, 1, 1] = value
    return dict(args, indices=indices)


@pytest.mark.parametrize("value", [8, 9, 1000, -2, -8, -(2**31)])
@pytest.mark.parametrize("mode", ["eager", "autograd", "compiled"])
def test_sparse_indices_outside_minus_one_to_t_are_refused(value, mode):
    args = _with_index(value)
    if mode == "autograd":  # through the custom op (the eager fast path skips the dispatcher)
        args["q"].requires_grad_(True)
    call = lambda: ops.dsa_sparse_attention(**args)  # noqa: E731
    if mode == "compiled":
        call = lambda: _compiled(ops.dsa_sparse_attention, False)(args)  # noqa: E731
    try:
        kind, line = _raised(call)
    finally:
        torch._dynamo.reset()
    assert kind is ValueError, line
    assert line == (f"indices must be -1 (no key) or key indices in [0, T) = [0, 8), got {value} at "
                    "indices[0, 1, 1] (1 entries out of range)")


@pytest.mark.parametrize("offsets", [[0, 4, 5], [0, 4, 2, 6], [1, 6]])
def test_indexer_bad_offsets_compiled_as_eager(offsets):
    # Values are checked inside the op when it runs: the same ValueError from a compiled graph.
    args = dict(_indexer(), q=_randn(1, 6, 2, 8), weights=_randn(1, 6, 2),
                cu_seqlens=torch.tensor(offsets, dtype=torch.int32))
    eager = _raised(lambda: ops.dsa_indexer_topk(**args))
    try:
        assert eager[0] is ValueError and eager[1].startswith("cu_seqlens must be")
        assert _raised(lambda: _compiled(ops.dsa_indexer_topk, False)(args)) == eager
    finally:
        torch._dynamo.reset()


def test_sparse_edge_indices_are_accepted():
    # -1 and T - 1 are valid: the result is the dense softmax over the named keys.
    args = _with_index(7)
    args["indices"][0, 2] = torch.tensor([-1, -1], dtype=torch.int32)
    o, lse = ops.dsa_sparse_attention(**args)
    q, k, idx = args["q"].double(), args["k"].double(), args["indices"]
    for i in range(3):
        keys = [int(j) for j in idx[0, i] if j >= 0]
        if not keys:
            assert torch.all(o[0, i] == 0) and torch.all(lse[0, i] == -math.inf)
            continue
        s = torch.einsum("hd,kd->hk", q[0, i], k[0, keys, 0]) * 12 ** -0.5
        torch.testing.assert_close(lse[0, i].double(), torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)
        expected = torch.softmax(s, -1) @ k[0, keys, 0, :8]
        torch.testing.assert_close(o[0, i].double(), expected, rtol=1e-5, atol=1e-5)


def test_sparse_index_values_checked_on_cuda_only_on_request(monkeypatch):
    # A CUDA tensor's values cost a device synchronisation: read only with KDA_COMPILE_CHECK_INPUTS=1.
    cuda_like = torch.empty(1, 1, 1, dtype=torch.int32, device="meta")
    monkeypatch.delenv("KDA_COMPILE_CHECK_INPUTS", raising=False)
    assert dsa_custom_ops.indices_checked(torch.zeros(1, 1, 1, dtype=torch.int32))
    assert not dsa_custom_ops.indices_checked(cuda_like)
    monkeypatch.setenv("KDA_COMPILE_CHECK_INPUTS", "1")
    assert dsa_custom_ops.indices_checked(cuda_like)


# ----------------------------------------------------------------------------------------------
# Empty sequences: empty or zero outputs, as the KDA ops' T = 0
# ----------------------------------------------------------------------------------------------
def test_kda_t0_is_the_rule_followed():
    # KDA with T = 0: an empty output and the initial state passed through; the attention ops follow it.
    a = _delta_rule(False)()
    empty = {n: t[:, :0] for n, t in a.items()}
    h0 = _randn(1, 2, 8, 8)
    o, final = ops.chunk_kda(**empty, initial_state=h0, output_final_state=True)
    assert o.shape == (1, 0, 2, 8) and torch.equal(final, h0)


@pytest.mark.parametrize("sq,sk", [(0, 4), (3, 0), (0, 0)])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_attention_without_queries_or_keys(sq, sk, sinks, compiled):
    q = _randn(2, 4, sq, 8).requires_grad_(True)
    k, v = _randn(2, 2, sk, 8).requires_grad_(True), _randn(2, 2, sk, 6).requires_grad_(True)
    sink = _randn(4).requires_grad_(True) if sinks else None
    fn = ops.attention_with_lse
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out, lse = fn(q, k, v, is_causal=True, sinks=sink)
    assert out.shape == (2, 4, sq, 6) and out.transpose(1, 2).is_contiguous()  # the op's [B, Sq, H, Dv] storage
    assert torch.all(out == 0)  # a softmax over zero keys: every key masked out, so 0 (not NaN)
    expected = sink.detach().view(1, 4, 1).expand(2, 4, sq) if sinks else torch.full((2, 4, sq), -math.inf)
    assert torch.equal(lse.detach(), expected)
    (out.sum() + lse.sum()).backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.all(t.grad == 0)
    if sinks:  # lse = logaddexp(-inf, sink): d lse / d sink = 1 per row
        assert torch.equal(sink.grad, torch.full((4,), 2.0 * sq))
    torch._dynamo.reset()


def test_attention_without_keys_is_a_fully_masked_row():
    q, k, v = _randn(1, 2, 3, 8), _randn(1, 1, 4, 8), _randn(1, 1, 4, 6)
    masked = ops.attention(q, k, v, attn_mask=torch.zeros(1, 4, dtype=torch.bool))
    assert torch.equal(ops.attention(q, k[:, :, :0], v[:, :, :0]), masked)


@pytest.mark.parametrize("sq,t", [(0, 5), (3, 0)])
@pytest.mark.parametrize("path", ["auto", "absorbed", "expanded"])
def test_mla_without_queries_or_cache(sq, t, path):
    a = _mla()
    a = dict(a, q_nope=a["q_nope"][:, :, :sq], q_rope=a["q_rope"][:, :, :sq], kv_latent=a["kv_latent"][:, :t],
             k_rope=a["k_rope"][:, :t], path=path, is_causal=True)
    out = ops.mla_attention(**a)
    assert out.shape == (1, 2, sq, 6) and torch.all(out == 0)


def test_dsa_without_keys():
    # T = 0: the indexers select nothing (all -1); the attention over no key gives o = 0, lse = -inf.
    a = _indexer()
    assert torch.equal(ops.dsa_indexer_topk(**dict(a, k=a["k"][:, :0], is_causal=False)),
                       torch.full((1, 4, 3), -1, dtype=torch.int32))
    p = _pooled()
    assert torch.equal(ops.dsa_pooled_indexer_topk(**dict(p, k=p["k"][:, :0], gate=p["gate"][:, :0])),
                       torch.full((1, 4, 5), -1, dtype=torch.int32))
    s = _sparse()
    q = s["q"].requires_grad_(True)
    k = s["k"][:, :0].requires_grad_(True)
    o, lse = ops.dsa_sparse_attention(q, k, None, torch.full((1, 3, 2), -1, dtype=torch.int32), d_v=8)
    assert o.shape == (1, 3, 4, 8) and torch.all(o == 0) and torch.all(lse == -math.inf)
    o.sum().backward()
    assert torch.all(q.grad == 0) and k.grad.shape == k.shape
    with pytest.raises(ValueError, match=r"indices must be .* \[0, T\) = \[0, 0\), got 0"):
        ops.dsa_sparse_attention(q, k, None, torch.zeros(1, 3, 2, dtype=torch.int32), d_v=8)


def test_opcheck_on_empty_problems():
    opcheck = torch.library.opcheck
    q, k, v = _randn(2, 4, 3, 8), _randn(2, 2, 0, 8), _randn(2, 2, 0, 6)
    opcheck(torch.ops.kda_compile.attention_fwd.default, (q, k, v, None, None, 0.3, 0.0, 0.0, True, 0, True))
    out, lse, rng = torch.ops.kda_compile.attention_fwd(q, k, v, None, None, 0.3, 0.0, 0.0, True, 0, True)
    opcheck(torch.ops.kda_compile.attention_bwd.default,
            (torch.ones_like(out), torch.ones_like(lse), q, k, v, out, lse, rng, None, None, 0.3, 0.0, 0.0, True, 0,
             False))
    m = _mla()
    mla_args = (m["q_nope"], m["q_rope"], m["kv_latent"][:, :0], m["k_rope"][:, :0], m["kv_b_weight"], None, 0.3,
                True, "auto")
    opcheck(torch.ops.kda_compile.mla_attention_fwd.default, mla_args)
    mla_out = torch.ops.kda_compile.mla_attention_fwd(*mla_args)
    opcheck(torch.ops.kda_compile.mla_attention_bwd.default, (torch.ones_like(mla_out), *mla_args, False))
    s = _sparse()
    none = torch.full((1, 3, 2), -1, dtype=torch.int32)
    sparse_args = (s["q"], s["k"][:, :0], None, none, 0.3, 8)
    opcheck(torch.ops.kda_compile.dsa_sparse_attention_fwd.default, sparse_args)
    o, lse = torch.ops.kda_compile.dsa_sparse_attention_fwd(*sparse_args)
    opcheck(torch.ops.kda_compile.dsa_sparse_attention_bwd.default,
            (torch.ones_like(o), torch.ones_like(lse), s["q"], s["k"][:, :0], None, none, o, lse, 0.3, 8))
    a = _indexer()
    opcheck(torch.ops.kda_compile.dsa_indexer_topk.default,
            (a["q"], a["k"][:, :0], a["weights"], None, None, 3, 1.0, False))


# ----------------------------------------------------------------------------------------------
# DSA indexer in float64: the reference, as the README's support matrix says
# ----------------------------------------------------------------------------------------------
def _dense_topk(q, k, weights, topk, scale):
    """int32 [B, S, topk] by a dense float64 score and Python's stable sort (not causal): an independent oracle."""
    scores = (torch.einsum("bshd,btd->bsht", q.double(), k.double()) * scale).clamp_min(0)
    scores = (scores * weights.double()[..., None]).sum(2)
    b, s_len, t_len = scores.shape
    out = torch.full((b, s_len, topk), -1, dtype=torch.int32)
    for bi in range(b):
        for i in range(s_len):
            best = sorted(sorted(range(t_len), key=lambda t: (-float(scores[bi, i, t]), t))[:topk])
            out[bi, i, :len(best)] = torch.tensor(best, dtype=torch.int32)
    return out


@pytest.mark.parametrize("compiled", [False, True])
def test_indexer_float64_runs_the_reference(compiled):
    q, k, w = _randn(2, 5, 3, 8, dtype=torch.float64), _randn(2, 9, 8, dtype=torch.float64), _randn(2, 5, 3)
    fn = ops.dsa_indexer_topk
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    got = fn(q, k, w, 4, scale=0.5, is_causal=False)
    torch._dynamo.reset()
    assert torch.equal(got, indexer_topk_reference(q, k, w, None, None, 4, 0.5, False))
    assert torch.equal(got, _dense_topk(q, k, w, 4, 0.5))
