"""Test helpers for Kimi Delta Attention: hypothesis strategies and relative-error assertions.

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
hypothesis: fixed regression cases). Needs ``hypothesis`` (``pip install kda-compile[test]``).
"""
from kda_compile.testing.assertions import assert_rel_close, rel_error
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
