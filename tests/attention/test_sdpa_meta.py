"""The CUDA glue calls torch's real SDPA backend ops correctly: checked on CPU with meta tensors.

The aten ops (``_scaled_dot_product_cudnn_attention``, ``_flash_attention_forward``,
``_efficient_attention_forward`` and their backward ops) have meta kernels, so running
``dispatch.cuda_forward`` / ``cuda_backward`` on meta tensors exercises our argument lists, keyword
names, output unpacking, layouts and fix-ups against this torch's schemas, without a GPU. (Numerics
are covered by test_sdpa_glue.py on CPU and test_attention_cuda.py on the GPU box.)
"""
import pytest
import torch

from kda_compile.ops.attention import kernels as dispatch, sdpa

CASES = [  # (B, H, Hkv, Sq, Sk, Dqk, Dv, causal, window, mask, sinks)
    (2, 8, 2, 33, 33, 64, 64, True, 0, None, True),
    (1, 4, 4, 5, 40, 128, 128, True, 16, "bool", False),
    (2, 4, 4, 7, 9, 192, 128, False, 0, "float", True),
    (3, 8, 1, 1, 50, 128, 128, True, 0, None, True),
]


def _servable(backend, h, hkv, dqk, dv, mask, window):
    if backend == "flash":
        return dqk == dv and mask is None
    if backend == "efficient":
        return h == hkv and window == 0
    return window == 0


@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_glue_runs_the_real_ops_on_meta_tensors(monkeypatch, backend, case):
    b, h, hkv, sq, sk, dqk, dv, causal, window, mask_kind, with_sinks = case
    if not _servable(backend, h, hkv, dqk, dv, mask_kind, window):
        pytest.skip(f"{backend} is never chosen for this case")
    monkeypatch.setattr(dispatch, "_FAST_DTYPES", (torch.bfloat16,))
    monkeypatch.setattr(dispatch, "triton_unavailable", lambda: "meta tensors")
    monkeypatch.setattr(sdpa, "choose", lambda *a, **k: (backend, {}))

    def empty(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")

    q = empty(b, sq, h, dqk).transpose(1, 2)
    k = empty(b, sk, hkv, dqk).transpose(1, 2)
    v = empty(b, sk, hkv, dv).transpose(1, 2)
    mask = {None: None, "bool": empty(b, 1, sq, sk, dtype=torch.bool), "float": empty(sq, sk, dtype=torch.float32)}[mask_kind]
    sinks = empty(h, dtype=torch.float32) if with_sinks else None
    no_rng = torch.empty(0, dtype=torch.int64)

    out, lse = dispatch.cuda_forward(q, k, v, mask, sinks, 0.1, 0.0, 0.0, causal, window, no_rng)
    assert out.shape == (b, h, sq, dv) and out.dtype == torch.bfloat16
    assert out.stride() == dispatch.bshd_strides(out.shape)
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32 and lse.is_contiguous()

    if backend == "efficient":
        # torch's meta kernel for aten._efficient_attention_backward lacks the schema's `out` argument
        # (torch/_meta_registrations.py), so the meta call shifts every later argument; our call
        # follows the schema, which the CUDA kernel uses.
        pytest.skip("meta kernel of _efficient_attention_backward does not match its schema")
    grads = dispatch.cuda_backward(torch.empty_like(out), None, q, k, v, out, lse, no_rng, mask, sinks, 0.1, 0.0, 0.0,
                                   causal, window, False)
    dq, dk, dv_, dmask, dsinks = grads
    for g, t in ((dq, q), (dk, k), (dv_, v)):
        assert g.shape == t.shape and g.dtype == t.dtype and g.stride() == dispatch.bshd_strides(g.shape)
    assert dmask is None and (dsinks is None) == (sinks is None)
    if sinks is not None:
        assert dsinks.shape == sinks.shape
