"""Which GDN backend serves a call, on the host (no GPU needed: the choice reads devices and flags only)."""
import torch

from kda_compile.ops.gdn.backends import fla as fla_backend
from kda_compile.ops.gdn.custom_ops import _options

CUDA = torch.device("cuda")


def test_fla_serves_training_only_where_its_backward_runs(monkeypatch):
    """fla-core 0.6 raises in its gated chunk backward on Hopper with Triton >= 3.4, < 3.7.1 (no tilelang):
    a forward that keeps residuals for a backward must not be served by FLA there, inference still is."""
    backend = fla_backend.FLAGDNBackend()
    monkeypatch.setattr(fla_backend, "_load_fla", lambda: (object(), None))
    refusal = "fla-core refuses its gated chunk backward on Hopper with Triton 3.6.0"
    monkeypatch.setattr(fla_backend, "_backward_refusal", lambda: refusal)
    inference, training = (_options(1.0, False, False, False, False, training=t) for t in (False, True))
    assert backend.unsupported_reason(CUDA, torch.bfloat16, 128, 128, inference) is None
    assert backend.unsupported_reason(CUDA, torch.bfloat16, 128, 128, training) == refusal
    monkeypatch.setattr(fla_backend, "_backward_refusal", lambda: None)
    assert backend.unsupported_reason(CUDA, torch.bfloat16, 128, 128, training) is None


def test_backward_refusal_reads_flas_own_flags(monkeypatch):
    import sys
    import types

    fake = types.SimpleNamespace(IS_NVIDIA_HOPPER=True, TRITON_ABOVE_3_4_0=True, TRITON_ABOVE_3_7_1=False)
    common = types.ModuleType("fla.ops.common")
    common.chunk_o = fake
    for name, module in {"fla": types.ModuleType("fla"), "fla.ops": types.ModuleType("fla.ops"),
                         "fla.ops.common": common}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(fla_backend.importlib.util, "find_spec", lambda name: None)
    fla_backend._backward_refusal.cache_clear()
    try:
        assert "refuses its gated chunk backward" in fla_backend._backward_refusal()
        fake.TRITON_ABOVE_3_7_1 = True
        fla_backend._backward_refusal.cache_clear()
        assert fla_backend._backward_refusal() is None
    finally:
        fla_backend._backward_refusal.cache_clear()
