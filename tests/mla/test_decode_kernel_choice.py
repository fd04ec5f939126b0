"""The absorbed-decode kernel choice (``ops/mla/decode/kernels.py``), the wgmma kernel's source generation
and the NVRTC wrapper, on any machine (the kernel itself: ``test_wgmma_decode.py``, sm_90 only)."""
import pytest
import torch

from kda_compile.ops import _nvrtc
from kda_compile.ops._common import clear_fallback_events, fallback_events
from kda_compile.ops.mla.decode import kernels as decode_kernels, wgmma_decode, wgmma_decode_source as wgmma_source
from kda_compile.ops.mla.decode.triton_decode import choose_num_splits

H100_SHARED_OPT_IN = 232448  # bytes of shared memory one block may opt into on sm_90


def cpu_inputs(h=64):
    return (torch.randn(1, h, 1, 512, dtype=torch.bfloat16), torch.randn(1, h, 1, 64, dtype=torch.bfloat16),
            torch.randn(1, 10, 512, dtype=torch.bfloat16), torch.randn(1, 10, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("value, expected", [(None, "auto"), ("", "auto"), ("Triton", "triton"), (" wgmma ", "wgmma")])
def test_requested_kernel_reads_the_environment(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(decode_kernels.KERNEL_ENV, raising=False)
    else:
        monkeypatch.setenv(decode_kernels.KERNEL_ENV, value)
    assert decode_kernels.requested_kernel() == expected


def test_a_bad_kernel_name_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(decode_kernels.KERNEL_ENV, "cutlass")
    with pytest.raises(ValueError, match=r"KDA_COMPILE_MLA_DECODE_KERNEL must be one of auto, triton, wgmma, "
                                         r"got 'cutlass'"):
        decode_kernels.requested_kernel()


def test_cpu_tensors_take_triton_without_a_fallback(monkeypatch):
    monkeypatch.delenv(decode_kernels.KERNEL_ENV, raising=False)
    clear_fallback_events()
    assert decode_kernels.choose_decode_kernel(*cpu_inputs()) == ("triton", "not a CUDA tensor")
    assert not fallback_events(), "Triton is the designed kernel off sm_90, not a fallback"


def test_forcing_wgmma_where_it_cannot_run_is_logged(monkeypatch):
    monkeypatch.setenv(decode_kernels.KERNEL_ENV, "wgmma")
    clear_fallback_events()
    assert decode_kernels.choose_decode_kernel(*cpu_inputs())[0] == "triton"
    assert [e.reason for e in fallback_events()] == ["the wgmma decode kernel cannot run this call: not a CUDA tensor"]


def test_forcing_triton_is_honoured(monkeypatch):
    monkeypatch.setenv(decode_kernels.KERNEL_ENV, "triton")
    assert decode_kernels.choose_decode_kernel(*cpu_inputs()) == ("triton", "KDA_COMPILE_MLA_DECODE_KERNEL=triton")


def test_shared_memory_fits_one_block_per_sm():
    assert wgmma_source.SHARED_BYTES <= H100_SHARED_OPT_IN
    assert wgmma_source.TILE_BYTES == 64 * 576 * 2


@pytest.mark.parametrize("elem, causal, mask_kind, partial", [("bf16", False, 0, False), ("f16", True, 2, True)])
def test_kernel_source_specialises(elem, causal, mask_kind, partial):
    text = wgmma_source.kernel_source(elem=elem, is_causal=causal, mask_kind=mask_kind, partial=partial)
    assert f"#define IS_CAUSAL {int(causal)}\n" in text and f"#define MASK_KIND {mask_kind}\n" in text
    assert f"#define PARTIAL {int(partial)}\n" in text
    assert f"m64n64k16.f32.{elem}.{elem}" in text and f"m64n256k16.f32.{elem}.{elem}" in text
    assert "ELEM_PTX" not in text


@pytest.mark.parametrize("kwargs, message", [
    (dict(elem="f32", is_causal=False, mask_kind=0, partial=False), "elem must be 'bf16' or 'f16', got 'f32'"),
    (dict(elem="bf16", is_causal=False, mask_kind=3, partial=False), "mask_kind must be 0, 1 or 2, got 3"),
])
def test_kernel_source_rejects_bad_specialisations(kwargs, message):
    with pytest.raises(ValueError, match=message):
        wgmma_source.kernel_source(**kwargs)


def test_kernel_source_rejects_unknown_switches():
    with pytest.raises(ValueError, match=r"switches must be among \['DBG_NO_PV', 'DBG_NO_S', 'DBG_NO_SOFTMAX'\], "
                                         r"got \['SPLIT_S'\]"):
        wgmma_source.kernel_source(elem="bf16", is_causal=False, mask_kind=0, partial=False, switches={"SPLIT_S": 1})


@pytest.mark.parametrize("programs, tiles, expected", [
    (128, 256, 1),  # batch 64 x 2 head blocks, cache 16k: one wave unsplit (the plain wave model said 37)
    (64, 256, 2),  # batch 64 x 1 head block, cache 16k: two splits still fit one wave
    (16, 256, 8),  # batch 8 x 2 head blocks: eight splits fill the GPU
    (128, 64, 1),  # batch 64, cache 4k, 128 heads
])
def test_wgmma_split_rule_counts_the_query_load_and_the_partials(programs, tiles, expected):
    """Measured on an H100 (2026-11-22, docs/mla-decode-kernels.md section 4): 1 / 2 / 8 / 1 splits were the
    fastest."""
    assert choose_num_splits(programs, tiles, 132, 4, program_tiles=wgmma_decode.QUERY_TILES,
                             partial_tiles=wgmma_decode.PARTIAL_TILES) == expected


def test_nvrtc_compiles_the_kernel_or_says_why_not():
    """Where NVRTC loads (no GPU needed), every specialisation compiles for sm_90a; where it does not
    (CPU-only torch), the failure is the documented NvrtcUnavailable the launcher turns into a fallback."""
    try:
        _nvrtc.nvrtc_library()
    except _nvrtc.NvrtcUnavailable as exc:
        assert str(exc)
        return
    for elem in ("bf16", "f16"):
        source = wgmma_source.kernel_source(elem=elem, is_causal=True, mask_kind=1, partial=True)
        cubin = _nvrtc.compile_cubin(source, wgmma_source.KERNEL_NAME, "90a")
        assert cubin[:4] == b"\x7fELF"
    with pytest.raises(_nvrtc.NvrtcUnavailable, match="could not compile"):
        _nvrtc.compile_cubin("this is not C++", "broken", "90a")
