"""Our scan kernel over FLA 0.6's chunk intermediates (``triton_fla_scan.scan_fla_intermediates``), against
the same recurrence in float64 on the same intermediates (``fla_formats.py``). Under the Triton
interpreter on CPU; on CUDA when there is one (the device suite), where bf16 takes bf16 products.

Tolerances (relative, ``||a - b|| / ||b||``): float32 1e-5 (interpreted: fp32 products; on CUDA the
operands are rounded to TF32, 2^-11 each: 2e-3); bfloat16 2e-2 (the state and ``v_new`` are bf16 operands,
as in FLA's kernels, plus the bf16 outputs)."""
from __future__ import annotations

import pytest
import torch

from kda_compile.ops.kda.reference import l2norm
from kda_compile.ops.kda.backends.fla_scan import scan_fla_intermediates
from kda_compile.testing import assert_rel_close
from triton_device import INTERPRETED, triton_device

from .fla_formats import LN2, chunk_spans, intra, local_cumsum, states

DEVICE = triton_device("the Triton scan kernel")
TOL = {torch.float32: 1e-5 if INTERPRETED or DEVICE.type == "cpu" else 2e-3, torch.bfloat16: 2e-2}

CASES = {
    # B, T, H, HV, K, V, cu_seqlens, initial state, segments
    "one-chunk": (1, 40, 1, 1, 16, 16, None, False, 1),
    "gva-tail-state": (2, 150, 1, 2, 32, 48, None, True, 1),
    "segments": (1, 300, 1, 1, 16, 32, None, True, 3),
    "varlen-empty-seq": (1, 140, 2, 2, 16, 16, [0, 0, 70, 71, 140], True, 1),
    "varlen-segments": (1, 260, 1, 1, 16, 16, [0, 200, 260], False, 2),
}


def _intermediates(case, dtype, seed=0):
    B, T, H, HV, K, V, cu, with_h0, _ = case
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = l2norm(rand(B, T, H, K)), l2norm(rand(B, T, H, K))
    v, beta = rand(B, T, HV, V), torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, T, HV, K, generator=gen, dtype=torch.float64) * 0.3
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    N = B if cu is None else len(cu) - 1
    h0 = rand(N, HV, K, V) * 0.5 if with_h0 else None
    G = local_cumsum(g, T, cu_seqlens, 64, 1 / LN2)
    w, u, qg, kg, Aqk, Akk = intra(q, k, v, G, beta, K ** -0.5, cu_seqlens, 64)
    cast = lambda x: x.to(dtype).to(DEVICE).contiguous()  # noqa: E731
    tensors = dict(qg=cast(qg), w=cast(w), u=cast(u), kg=cast(kg), Aqk=cast(Aqk), g_cumsum=G.to(DEVICE),
                   initial_state=None if h0 is None else h0.float().to(DEVICE),
                   cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(DEVICE))
    return tensors, K ** -0.5


def _expected(t, scale):
    """o, final state, h, v_new in float64 from the (already rounded) intermediates."""
    f = torch.float64
    h, v_new, final = states(t["w"].cpu(), t["u"].cpu(), t["kg"].cpu(), t["g_cumsum"].cpu(),
                             None if t["initial_state"] is None else t["initial_state"].cpu(),
                             None if t["cu_seqlens"] is None else t["cu_seqlens"].cpu(), 64)
    qg, Aqk = t["qg"].cpu().to(f), t["Aqk"].cpu().to(f)
    B, T, HV, _ = qg.shape
    o = torch.zeros(B, T, HV, v_new.shape[-1], dtype=f)
    slot = 0
    for spans in chunk_spans(T, None if t["cu_seqlens"] is None else t["cu_seqlens"].cpu(), 64):
        for c, (s, e) in enumerate(spans):
            index = slot + c if t["cu_seqlens"] is not None else c
            A = torch.tril(Aqk[:, s:e, :, :e - s].permute(0, 2, 1, 3))  # [B, HV, i, j]
            o[:, s:e] = scale * torch.einsum("bihk,bhkv->bihv", qg[:, s:e], h[:, index]) \
                + torch.einsum("bhij,bjhv->bihv", A, v_new[:, s:e])
        if t["cu_seqlens"] is not None:
            slot += len(spans)
    return o, final, h, v_new


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", CASES)
def test_scan_matches_the_recurrence_on_flas_intermediates(name, dtype):
    t, scale = _intermediates(CASES[name], dtype)
    o, final, h, v_new = scan_fla_intermediates(**t, scale=scale, output_final_state=True, store_states=True,
                                                segments=CASES[name][-1])
    o_ref, final_ref, h_ref, v_new_ref = _expected(t, scale)
    tol = TOL[dtype]
    assert o.dtype == dtype and final.dtype == torch.float32 and h.dtype == dtype and v_new.dtype == dtype
    assert_rel_close(o, o_ref, tol, name="o")
    assert_rel_close(final, final_ref, tol, name="final_state")
    assert_rel_close(v_new, v_new_ref, tol, name="v_new")
    assert_rel_close(h[:, :h_ref.shape[1]], h_ref, tol, name="h")
    # FLA's backward recompute: the states alone, no o
    none, final2, h2, v_new2 = scan_fla_intermediates(**{**t, "qg": None}, scale=scale, output_final_state=True,
                                                      store_o=False, store_states=True, segments=CASES[name][-1])
    assert none is None
    assert torch.equal(h2[:, :h_ref.shape[1]], h[:, :h_ref.shape[1]]) and torch.equal(v_new2, v_new)
    assert torch.equal(final2, final)


def test_bad_input_is_refused_with_the_argument_named():
    t, scale = _intermediates(CASES["one-chunk"], torch.float32)
    with pytest.raises(ValueError, match="w must be contiguous"):
        scan_fla_intermediates(**{**t, "w": torch.cat([t["w"], t["w"]], -1)[..., ::2]}, scale=scale,
                               output_final_state=False)
    with pytest.raises(ValueError, match="g_cumsum must be float32"):
        scan_fla_intermediates(**{**t, "g_cumsum": t["g_cumsum"].double()}, scale=scale, output_final_state=False)
    with pytest.raises(ValueError, match="store_o=True needs qg"):
        scan_fla_intermediates(**{**t, "qg": None}, scale=scale, output_final_state=False)
