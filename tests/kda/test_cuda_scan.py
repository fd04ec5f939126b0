"""The CUDA scan kernel (ops/kda/prefill/cuda/scan*.py): its choice, cost rule and fallbacks (CPU), and on CUDA the
whole forward with it against the Triton scan and the fp64 recurrence, and repeatability."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_compile.ops._common import clear_fallback_events, fallback_events
from kda_compile.ops.kda.prefill.cuda import scan as cuda_scan
from kda_compile.ops.kda.prefill.cuda import scan_source as src
from kda_compile.ops.kda.prefill import plan
from kda_compile.ops.kda.prefill import run as triton_chunk
from kda_compile.ops.kda.reference import kda_reference
from kda_compile.testing import kda_inputs, rel_error

from .prefill_check import check, weaken_decays
from .recurrence import tolerances_for

K = V = 128
LB = -5.0
cuda = pytest.mark.cuda


# ---- CPU: source generation, choice, cost rule, fallbacks ---------------------------------------------------
def test_source_rejects_unknown_options_by_name():
    base = dict(cu_dtype="int", varlen=False, has_h0=True, store_ht=True, stages=2, block_v=64)
    assert "kda_scan_mma" in src.kernel_source(**base)
    for key, bad, message in (("cu_dtype", "short", "cu_dtype must be"), ("stages", 4, "stages must be 2 or 3"),
                              ("block_v", 96, r"block_v must be one of \(32, 64, 128\), got 96")):
        with pytest.raises(ValueError, match=message):
            src.kernel_source(**{**base, key: bad})
    with pytest.raises(ValueError, match=r"stages=3 with block_v=128 needs 239104 bytes of shared memory"):
        src.kernel_source(**{**base, "stages": 3, "block_v": 128})


@pytest.mark.parametrize("block_v", src.BLOCK_VS)
@pytest.mark.parametrize("row_factors", [False, True])
def test_shared_memory_fits_an_h100_sm(block_v, row_factors):
    """227 KiB of dynamic shared memory per block on sm_90, for the launcher's stage count."""
    assert src.shared_bytes(cuda_scan.STAGES, block_v, row_factors) <= 227 * 1024


@pytest.mark.parametrize("pairs, block_v", [(1, 32), (33, 32), (34, 64), (64, 64), (66, 64), (67, 128), (96, 128),
                                            (132, 128), (256, 128), (4096, 128)])
def test_block_v_takes_the_fewest_costed_waves(pairs, block_v):
    """132 SMs: 32 columns while their four CTAs a pair fit one wave, 64 while two do, then one CTA of 128 a pair
    (one wave of 128 costs less than two of 64)."""
    assert cuda_scan.block_v_for(pairs, 132) == block_v


def test_requested_kernel_validates_the_environment(monkeypatch):
    monkeypatch.setenv(cuda_scan.KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="KDA_COMPILE_SCAN_KERNEL must be one of auto, triton, cuda, got 'fast'"):
        cuda_scan.requested_kernel()


def _choose(w, **overrides):
    kwargs = dict(num_seqs=1, gate_cumsum=False, writes_chunk_states=False, writes_o=True, segments_asked=False,
                  cuda_faster=lambda: True)
    kwargs.update(overrides)
    return cuda_scan.choose_scan_kernel(w, w, None, torch.empty(0, dtype=torch.int32), **kwargs)


def test_forced_cuda_outside_the_design_runs_triton_and_records_why(monkeypatch):
    w = torch.zeros(64, 2, K, dtype=torch.bfloat16)
    clear_fallback_events()
    monkeypatch.setenv(cuda_scan.KERNEL_ENV, "auto")
    assert _choose(w) == "triton"
    assert not fallback_events()  # auto: Triton is the kernel for CPU tensors, not a fallback
    monkeypatch.setenv(cuda_scan.KERNEL_ENV, "cuda")
    assert _choose(w) == "triton"
    reasons = [e.reason for e in fallback_events()]
    assert reasons == ["the CUDA scan kernel cannot run this call: not a CUDA tensor"]
    clear_fallback_events()


def test_the_cuda_scan_needs_sm_90(monkeypatch):
    """stmatrix is sm_90: an sm_80 GPU is outside the design (Triton runs there, no NVRTC failure)."""
    class CudaTensorLike:  # what the device check reads of a CUDA tensor
        is_cuda, device = True, torch.device("cuda", 0)

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from kda_compile.ops.kda.prefill.cuda import choice as cuda_choice

    monkeypatch.setattr(cuda_choice, "device_capability", lambda index: (8, 0))
    why = cuda_scan.outside_design(CudaTensorLike(), None, None, None, num_seqs=1, gate_cumsum=False,
                                   writes_chunk_states=False, writes_o=True)
    assert why == "needs sm_90 or newer (bf16 mma.sync and stmatrix), got sm_80"


def test_asked_segments_keep_the_triton_scan(monkeypatch):
    monkeypatch.setenv(cuda_scan.KERNEL_ENV, "auto")
    called = []
    assert _choose(torch.zeros(1, 1, K), segments_asked=True, cuda_faster=lambda: called.append(1)) == "triton"
    assert not called


def test_cost_rule_prefers_the_cuda_scan_except_with_few_heads_on_long_sequences():
    """The measured crossover (H100, 132 SMs): the CUDA scan is faster on every anchor shape but the single
    65536-token sequence with 16 heads (1.71 against 1.34 ms), and for a sequence with 2 heads."""
    def faster(B, T, H):
        sms = 132
        P = plan.choose_segments(B, H, 2, 4, T // 64, sms)
        return plan.cuda_scan_cost(B, H, T // 64, sms) <= plan.segment_cost(
            B, H, 2, 4, T // 64, sms, P)

    for shape in ((1, 8192, 32), (8, 4096, 32), (1, 32768, 32), (8, 1024, 32), (1, 8192, 64), (16, 2048, 32),
                  (2, 16384, 16)):
        assert faster(*shape), shape
    assert not faster(1, 65536, 16) and not faster(1, 8192, 2)


# ---- CUDA ---------------------------------------------------------------------------------------------------
def _inputs(B, T, H, HV, *, offsets=None, seed=0):
    """Fresh inputs with weak decays (raw gate randn - 4: about 0.2 nats a step), so the state carries across
    chunks."""
    torch.manual_seed(seed)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v = torch.randn(B, T, H, K, **bf16), torch.randn(B, T, H, K, **bf16), torch.randn(B, T, HV, V, **bf16)
    g = (torch.randn(B, T, HV, K, device="cuda") - 4.0).to(torch.bfloat16)
    beta = torch.randn(B, T, HV, **bf16)
    A_log, dt_bias = torch.rand(HV, device="cuda"), torch.randn(HV * K, device="cuda") * 0.1
    cu = torch.tensor(offsets, device="cuda", dtype=torch.int32) if offsets is not None else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, cu=cu)


def _forward(kernel, x, h0, final, monkeypatch):
    monkeypatch.setenv(cuda_scan.KERNEL_ENV, kernel)
    return triton_chunk.chunk_kda_prefill(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], h0, x["cu"], scale=K ** -0.5,
        output_final_state=final, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=LB)


CASES = {
    "batched_h0": (dict(B=2, T=300, H=2, HV=2), "contiguous", True),
    "no_h0": (dict(B=2, T=300, H=2, HV=2), None, True),
    "gva_strided_h0": (dict(B=1, T=256, H=4, HV=8), "strided", True),
    "varlen_empty_and_tails": (dict(B=1, T=333, H=4, HV=4, offsets=[0, 0, 100, 101, 333]), "contiguous", True),
    "varlen_no_final": (dict(B=1, T=200, H=2, HV=2, offsets=[0, 64, 64, 200]), None, False),
    "one_token": (dict(B=1, T=1, H=2, HV=2), "contiguous", True),
    "long_31_chunks": (dict(B=1, T=2000, H=2, HV=2), "contiguous", True),
}


def _force_block_v(monkeypatch, block_v):
    monkeypatch.setattr(triton_chunk, "cuda_block_v", lambda pairs, sm_count: block_v)


def _record_launches(monkeypatch) -> list[int]:
    """The block width of every CUDA scan launch from now on (the launches still run)."""
    launched, real = [], cuda_scan.launch_scan_cuda
    spy = lambda *a, **kw: (launched.append(kw["block_v"]), real(*a, **kw))  # noqa: E731
    monkeypatch.setattr(cuda_scan, "launch_scan_cuda", spy)  # (the scan chosen after the prepare)
    monkeypatch.setattr(triton_chunk, "launch_scan_cuda", spy)  # (the CUDA pair, chosen before the prepare)
    return launched


@cuda
@pytest.mark.parametrize("block_v", src.BLOCK_VS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_the_triton_scan_and_the_recurrence(case, block_v, monkeypatch):
    _force_block_v(monkeypatch, block_v)
    shape, h0_mode, final = CASES[case]
    x = _inputs(**shape)
    N = shape["B"] if x["cu"] is None else x["cu"].numel() - 1
    h0 = None
    if h0_mode == "contiguous":
        h0 = torch.randn(N, shape["HV"], K, V, device="cuda")
    elif h0_mode == "strided":
        h0 = torch.randn(N, K, shape["HV"], V, device="cuda").transpose(1, 2)
    clear_fallback_events()
    got = _forward("cuda", x, h0, final, monkeypatch)
    assert not fallback_events()
    want_triton = _forward("triton", x, h0, final, monkeypatch)
    ref_o, ref_final = kda_reference(
        x["q"].double(), x["k"].double(), x["v"].double(), x["g"].double(), x["beta"].double(), scale=K ** -0.5,
        cu_seqlens=x["cu"], initial_state=h0.double() if h0 is not None else None, A_log=x["A_log"].double(),
        dt_bias=x["dt_bias"].double(), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=LB)
    tol = tolerances_for(torch.bfloat16, "cuda")
    assert rel_error(got[0].double(), ref_o.double()) < tol["o"]
    # the same bf16 products as the plain Triton scan; segments (T = 2000) only move rounding
    assert rel_error(got[0].float(), want_triton[0].float()) < 5e-3
    if final:
        assert rel_error(got[1].double(), ref_final.double()) < tol["final_state"]
        assert rel_error(got[1], want_triton[1]) < 5e-3
    else:
        assert got[1] is None
    if x["cu"] is not None:  # tokens of no sequence stay zero
        assert torch.all(got[0][:, int(x["cu"][-1]):] == 0)


@cuda
@pytest.mark.parametrize("block_v", src.BLOCK_VS)
def test_repeated_runs_are_bitwise_identical(block_v, monkeypatch):
    _force_block_v(monkeypatch, block_v)
    x = _inputs(2, 700, 2, 2)
    h0 = torch.randn(2, 2, K, V, device="cuda")
    first, second = _forward("cuda", x, h0, True, monkeypatch), _forward("cuda", x, h0, True, monkeypatch)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@cuda
def test_auto_takes_the_cuda_scan_on_an_anchor_shape(monkeypatch):
    """1 x 8192 x 32 (bf16, K = V = 128): the CUDA scan runs once, with the block width its rule gives for
    this GPU, and no Triton scan or summary kernel is launched."""
    monkeypatch.setenv(cuda_scan.KERNEL_ENV, "auto")
    launched = _record_launches(monkeypatch)
    x = _inputs(1, 8192, 32, 32)
    _forward("auto", x, None, True, monkeypatch)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert launched == [cuda_scan.block_v_for(32, sms)]


@cuda
@settings(deadline=None)
@given(data=st.data(), block_v=st.sampled_from(src.BLOCK_VS), weak=st.booleans())
def test_drawn_inputs_through_the_cuda_scan(data, block_v, weak):
    """Drawn bf16 calls with K = V = 128 (packed sequences with empty ones, GVA, every gate form, initial states
    in both layouts, non-contiguous inputs, T up to 300) through the whole forward with the CUDA scan forced at
    a drawn block width, against the fp64 recurrence; the CUDA scan must have run, with no fallback."""
    args = data.draw(kda_inputs(max_T=300, key_dims=(K,), value_dims=(V,), dtypes=(torch.bfloat16,),
                                state_v_first=(False, True), noncontiguous=(False, True), device="cuda"),
                     label="args")
    clear_fallback_events()
    with pytest.MonkeyPatch.context() as patch:  # not the fixture: hypothesis runs the body many times
        patch.setenv(cuda_scan.KERNEL_ENV, "cuda")
        _force_block_v(patch, block_v)
        launched = _record_launches(patch)
        check(weaken_decays(args) if weak else args)
    assert launched and set(launched) == {block_v}
    assert not [e for e in fallback_events() if "scan" in e.reason]
