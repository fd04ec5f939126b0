"""Test helpers: hypothesis strategies for the KDA, attention and MLA ops, and relative-error assertions.

Fuzz your own shapes and options against kda_compile's ops (or check your own kernel against
them). ``kda_inputs`` draws a complete, valid argument set; ``assert_rel_close`` compares with the
relative RMS error ``||a - b|| / ||b||`` (float64, NaN and inf never pass)::

    import torch
    from hypothesis import given, settings
    from kda_compile.ops import chunk_kda, fused_recurrent_kda
    from kda_compile.testing import assert_rel_close, kda_inputs

    @settings(deadline=None)
    @given(kda_inputs(max_T=200, key_dims=(64, 128), gate_forms=("softplus",), varlen=True))
    def test_chunk_matches_recurrent(args):
        o_chunk, s_chunk = chunk_kda(**args)
        o_rec, s_rec = fused_recurrent_kda(**args)
        tol = 5e-3 if args["q"].dtype == torch.bfloat16 else 1e-4
        assert_rel_close(o_chunk, o_rec, tol, name="o")
        if args["output_final_state"]:
            assert_rel_close(s_chunk, s_rec, tol, name="final_state")

The drawn dict holds exactly the keyword arguments both ops accept, plus attributes describing
the draw (``args.shape``, ``args.seed``, ``args.gate_form``, ``args.num_seqs``). Building blocks:
``kda_shapes`` (B, T, H, HV, K, V under bounds), ``varlen_splits`` (``cu_seqlens`` offsets with
empty sequences) and ``make_kda_args`` (one argument set from a shape, options and a seed, without
hypothesis: fixed regression cases).

Softmax attention (``kda_compile.ops.attention``): ``attention_inputs`` draws the keyword arguments of
one call (GQA, ``Sq != Sk``, ``Dv != Dqk``, masks and their broadcasts, fully masked rows, causal +
sliding window, softcap, sinks, transposed inputs); ``attention_cases`` / ``AttentionCase`` and
``make_attention_args`` are its building blocks::

    import torch
    import torch.nn.functional as F
    from hypothesis import given, settings
    from kda_compile.ops import attention
    from kda_compile.testing import assert_rel_close, attention_inputs

    @settings(deadline=None)
    @given(attention_inputs(max_q_len=40, max_kv_len=40, head_dims=(16, 64), masks="none", causal=False,
                            softcaps=(None,), sinks=False, scales=(None,)))
    def test_attention_matches_sdpa(args):
        q, k, v = (args[n].double() for n in ("query", "key", "value"))
        expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert_rel_close(attention(**args), expected, 1e-5, name="out")

Gated delta rule (``kda_compile.ops.chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``):
``gdn_inputs`` draws a call (T = 1, odd T, grouped value heads, packed sequences with empty ones, every
flag), ``make_gdn_args`` builds one from a shape and a seed.

Multi-head latent attention (``kda_compile.ops.mla_attention``): ``mla_inputs`` draws a call as Hugging
Face's DeepSeek / Kimi attention makes it (decode, a chunk against a cache or prefill; masks including
left padding; HF's strided layouts); building blocks ``mla_cases`` / ``MLACase`` and ``make_mla_args``.

DeepSeek Sparse Attention (``kda_compile.ops.dsa_indexer_topk`` / ``dsa_sparse_attention``):
``dsa_indexer_inputs`` draws an indexer call (prefill, chunk, decode, packed ``cu_seqlens``, padded keys,
``topk`` above T, quantised inputs with exact ties), ``dsa_attention_inputs`` a sparse attention call
(absorbed ``v=None`` or GQA heads, -1 holes, empty rows); building blocks ``dsa_indexer_cases`` /
``DSAIndexerCase`` / ``make_dsa_indexer_args`` and ``dsa_attention_cases`` / ``DSAAttentionCase`` /
``make_dsa_attention_args``. glm5_next's pooled indexer (``dsa_pooled_indexer_topk``): ``dsa_pooled_inputs``
draws a call (prefill, chunk, decode, a static cache; pools of 1 to 16 around T's edges; left padding, holes,
padded queries; the key flags as None, a bool mask or HF's cache rows; quantised inputs with exact ties);
building blocks ``dsa_pooled_cases`` / ``DSAPooledCase`` / ``make_dsa_pooled_args`` / ``hf_cache_rows``.

Block-sparse attention (``kda_compile.ops.block_sparse_attention``, MiniMax-M3's sparse layers):
``block_sparse_inputs`` draws a call (prefill, a chunk, decode; GQA groups; block sizes around T's edges; -1
padding, repeated blocks and empty selections; explicit query positions; padded keys; HF's strided layout);
building blocks ``block_sparse_cases`` / ``BlockSparseCase`` / ``make_block_sparse_args``.

DeepSeek-V4's attention (``kda_compile.ops.compressed_sparse_attention``): ``compressed_attention_inputs`` draws a
call (sliding only, CSA picks with holes, HCA's closed entries; prefill, chunk, decode; windows wider and narrower
than the keys; left padding); building blocks ``compressed_attention_cases`` / ``CompressedAttentionCase`` /
``make_compressed_attention_args``.

Needs ``hypothesis``: ``pip install "kda-compile[testing]"``.
"""
try:
    import hypothesis  # noqa: F401  (every strategy module needs it: fail here, with the fix in the message)
except ImportError as exc:
    raise ImportError(
        'kda_compile.testing needs hypothesis, which is not installed: pip install "kda-compile[testing]"',
        name="hypothesis",
    ) from exc

from kda_compile.testing.assertions import assert_rel_close, rel_error
from kda_compile.testing.attention_strategies import (
    MASK_KINDS,
    MASK_SHAPES,
    AttentionArgs,
    AttentionCase,
    attention_cases,
    attention_inputs,
    make_attention_args,
)
from kda_compile.testing.block_sparse_strategies import (
    BLOCK_SPARSE_QUERY_KINDS,
    BlockSparseArgs,
    BlockSparseCase,
    block_sparse_cases,
    block_sparse_inputs,
    make_block_sparse_args,
)
from kda_compile.testing.compressed_attention_strategies import (
    COMPRESSED_KINDS,
    COMPRESSED_QUERY_KINDS,
    CompressedAttentionArgs,
    CompressedAttentionCase,
    compressed_attention_cases,
    compressed_attention_inputs,
    make_compressed_attention_args,
)
from kda_compile.testing.gdn_strategies import GDN_GATE_FORMS, GDNArgs, gdn_inputs, make_gdn_args
from kda_compile.testing.dsa_strategies import (
    DSA_QUERY_KINDS,
    DSAAttentionArgs,
    DSAAttentionCase,
    DSAIndexerArgs,
    DSAIndexerCase,
    dsa_attention_cases,
    dsa_attention_inputs,
    dsa_indexer_cases,
    dsa_indexer_inputs,
    make_dsa_attention_args,
    make_dsa_indexer_args,
)
from kda_compile.testing.dsa_pooled_strategies import (
    DSA_POOLED_QUERY_KINDS,
    KEY_FLAG_FORMS,
    DSAPooledArgs,
    DSAPooledCase,
    dsa_pooled_cases,
    dsa_pooled_inputs,
    hf_cache_rows,
    make_dsa_pooled_args,
)
from kda_compile.testing.mla_strategies import (
    MLA_MASK_KINDS,
    MLA_MASK_SHAPES,
    MLAArgs,
    MLACase,
    make_mla_args,
    mla_cases,
    mla_inputs,
)
from kda_compile.testing.strategies import (
    DEFAULT_HEAD_DIMS,
    GATE_FORMS,
    KDAArgs,
    KDAShape,
    kda_inputs,
    kda_shapes,
    make_kda_args,
    varlen_splits,
)

__all__ = [
    "MASK_KINDS",
    "MASK_SHAPES",
    "AttentionArgs",
    "AttentionCase",
    "attention_cases",
    "attention_inputs",
    "make_attention_args",
    "BLOCK_SPARSE_QUERY_KINDS",
    "BlockSparseArgs",
    "BlockSparseCase",
    "block_sparse_cases",
    "block_sparse_inputs",
    "make_block_sparse_args",
    "COMPRESSED_KINDS",
    "COMPRESSED_QUERY_KINDS",
    "CompressedAttentionArgs",
    "CompressedAttentionCase",
    "compressed_attention_cases",
    "compressed_attention_inputs",
    "make_compressed_attention_args",
    "GDN_GATE_FORMS",
    "GDNArgs",
    "gdn_inputs",
    "make_gdn_args",
    "DSA_QUERY_KINDS",
    "DSAAttentionArgs",
    "DSAAttentionCase",
    "DSAIndexerArgs",
    "DSAIndexerCase",
    "dsa_attention_cases",
    "dsa_attention_inputs",
    "dsa_indexer_cases",
    "dsa_indexer_inputs",
    "make_dsa_attention_args",
    "make_dsa_indexer_args",
    "DSA_POOLED_QUERY_KINDS",
    "KEY_FLAG_FORMS",
    "DSAPooledArgs",
    "DSAPooledCase",
    "dsa_pooled_cases",
    "dsa_pooled_inputs",
    "hf_cache_rows",
    "make_dsa_pooled_args",
    "MLA_MASK_KINDS",
    "MLA_MASK_SHAPES",
    "MLAArgs",
    "MLACase",
    "make_mla_args",
    "mla_cases",
    "mla_inputs",
    "DEFAULT_HEAD_DIMS",
    "GATE_FORMS",
    "KDAArgs",
    "KDAShape",
    "assert_rel_close",
    "kda_inputs",
    "kda_shapes",
    "make_kda_args",
    "rel_error",
    "varlen_splits",
]
