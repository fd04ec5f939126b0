"""How ``chunk_kda`` calls reach our Triton prefill backend (ops/kda/prefill/backend.py): what it declines,
its training paths, its preference for the bounded lower-bound gate, and the backend restriction across
threads. Host logic only: runs wherever triton is importable (the kernels are tested in
test_triton_chunk.py)."""
import logging
import math

import pytest
import torch

pytest.importorskip("triton", reason="the backend's module check and the kernel's limit need triton")

from kda_compile.ops.kda.backends import registry as backends  # noqa: E402
from kda_compile.ops.kda.backends.registry import (KDAOptions, only_backends, registered_backends,  # noqa: E402
                                                   select_backend)
from kda_compile.ops.kda.prefill.backend import (  # noqa: E402
    BOUNDED_GATE_LIMIT, REFERENCE_BACKWARD, TritonChunkBackend, training_path,
)


def test_backend_declines_what_it_cannot_serve():
    backend = TritonChunkBackend()
    opts = KDAOptions(scale=0.1)
    assert "needs CUDA" in backend.unsupported_reason(torch.device("cpu"), torch.float32, 64, 64, opts)
    cuda = torch.device("cuda")
    assert "float64" in backend.unsupported_reason(cuda, torch.float64, 64, 64, opts)
    assert "K=300" in backend.unsupported_reason(cuda, torch.bfloat16, 300, 64, opts)
    # Below FLA (preferred for some calls: prefill_backend's docstring), above the reference.
    assert registered_backends().index("fla") < registered_backends().index("triton_chunk")
    assert registered_backends().index("triton_chunk") < registered_backends().index("reference")
    assert "chunk_kda" in backend.serves and "fused_recurrent_kda" not in backend.serves


def test_training_path_without_fla_uses_the_reference_backward():
    # On CPU FLA never serves, so a training call would keep our forward and take the reference backward.
    path, reason = training_path(torch.device("cpu"), torch.float32, 64, 64, KDAOptions(scale=0.1))
    assert path == REFERENCE_BACKWARD and "FLA" in reason


def test_bounded_gates_stay_within_the_kernels_limit():
    """``BOUNDED_GATE_LIMIT`` nats per step over a 16-token block stays within the kernel's limit, and the
    prepare kernel leaves its exact-diagonal pass out only for lower-bound gates whose 16 steps stay within
    ``DIAG_RANGE_LIMIT``: every call the backend prefers is one of them."""
    from kda_compile.ops.kda.prefill.triton.prepare import DIAG_RANGE_LIMIT, MAX_BOUNDED_DECAY, exact_diagonal_needed
    from kda_compile.ops.kda.triton_common import GATE_LOWER_BOUND, GATE_PRECOMPUTED, GATE_SOFTPLUS

    assert 16 * BOUNDED_GATE_LIMIT / math.log(2.0) <= DIAG_RANGE_LIMIT.value
    assert 16 * MAX_BOUNDED_DECAY / math.log(2.0) < DIAG_RANGE_LIMIT.value
    lower = int(GATE_LOWER_BOUND)
    assert not exact_diagonal_needed(lower, -BOUNDED_GATE_LIMIT)
    assert not exact_diagonal_needed(lower, -MAX_BOUNDED_DECAY)
    assert not exact_diagonal_needed(lower, -0.01)
    assert exact_diagonal_needed(lower, -MAX_BOUNDED_DECAY * 1.001)
    assert exact_diagonal_needed(lower, None)
    assert exact_diagonal_needed(int(GATE_SOFTPLUS), None)
    assert exact_diagonal_needed(int(GATE_PRECOMPUTED), -1.0)


def test_bounded_lower_bound_gate_prefers_our_kernels(monkeypatch, caplog):
    """A backend above ours serves every other call; the bounded lower-bound gate, and every in-kernel gate the CUDA
    prepare kernel serves, come to ours first (forward, fake and backward all ask ``select_backend`` the same
    question)."""
    class Everything:
        name, serves = "everything", frozenset({"chunk_kda", "fused_recurrent_kda"})

        def unsupported_reason(self, *args):
            return None

    ours = TritonChunkBackend()
    monkeypatch.setattr(backends.REGISTRY, "entries", [(10, Everything()), (5, ours), (0, backends.REFERENCE)])
    cuda = torch.device("cuda")

    def chosen(**options):
        return select_backend("chunk_kda", cuda, torch.bfloat16, 128, 128, KDAOptions(scale=0.1, **options)).name

    bounded = dict(use_gate_in_kernel=True, lower_bound=-BOUNDED_GATE_LIMIT)
    assert ours.preferred_reason(cuda, torch.bfloat16, 128, 128, KDAOptions(scale=0.1, **bounded))
    monkeypatch.setattr(backends.REGISTRY, "_logged_preferences", set())
    with caplog.at_level(logging.INFO, logger="kda_compile.ops.kda"):
        assert chosen(**bounded) == "triton_chunk"
        assert chosen(**bounded) == "triton_chunk"
    said = [r.getMessage() for r in caplog.records if "ahead of its priority" in r.getMessage()]
    assert len(said) == 1 and "lower_bound=-5.0" in said[0]  # why, once
    assert chosen(use_gate_in_kernel=True, lower_bound=-0.5) == "triton_chunk"
    assert chosen(lower_bound=-1.0) == "everything"  # precomputed gates are not bounded
    # Other in-kernel gates come to ours where the CUDA prepare kernel serves them (any decay, no exact pass);
    # elsewhere the Triton prepare's exact pass would make their speed depend on the data.
    from kda_compile.ops.kda.prefill.cuda import choice as cuda_choice
    from kda_compile.ops.kda.prefill.cuda import prepare as cuda_prepare
    monkeypatch.setattr(cuda_prepare.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_choice, "device_capability", lambda index: (9, 0))
    monkeypatch.setattr(cuda_choice, "cuda_index", lambda device: 0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # (the CPU suite interprets Triton; the choice reads it)
    for strong in (dict(use_gate_in_kernel=True), dict(use_gate_in_kernel=True, lower_bound=-2 * BOUNDED_GATE_LIMIT)):
        assert chosen(**strong) == "triton_chunk"
        assert select_backend("chunk_kda", cuda, torch.float16, 128, 128,
                              KDAOptions(scale=0.1, **strong)).name == "everything"
        assert select_backend("chunk_kda", cuda, torch.bfloat16, 64, 64,
                              KDAOptions(scale=0.1, **strong)).name == "everything"
        monkeypatch.setenv(cuda_prepare.KERNEL_ENV, "triton")
        assert chosen(**strong) == "everything"
        monkeypatch.delenv(cuda_prepare.KERNEL_ENV)
    monkeypatch.setattr(cuda_choice, "device_capability", lambda index: (7, 5))
    assert chosen(use_gate_in_kernel=True) == "everything"
    assert select_backend("chunk_kda", torch.device("cpu"), torch.float32, 64, 64,
                          KDAOptions(scale=0.1, **bounded)).name == "everything"  # ours declines CPU


def test_backend_restriction_reaches_other_threads():
    """only_backends holds in every thread: autograd runs a CUDA backward on its own device thread, and
    that backward must see the restriction its forward saw (GPU run 2026-11-22: it did not, and the
    backward of a declined call went to FLA with no residuals)."""
    import threading

    seen = []
    opts = KDAOptions(scale=0.1)
    with only_backends("reference"):
        worker = threading.Thread(target=lambda: seen.append(
            select_backend("chunk_kda", torch.device("cuda"), torch.bfloat16, 64, 64, opts).name))
        worker.start()
        worker.join()
    assert seen == ["reference"]
