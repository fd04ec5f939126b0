"""Every CUDA source we compile at run time with NVRTC compiles for its GPUs on any machine with NVRTC, no GPU
needed (the test extra installs NVRTC 12.9's wheel on Linux x86_64; without it the tests skip): a typo in a kernel
source, or a specialisation that stopped compiling, fails here on the CPU CI instead of on the GPU box, where a
compile failure would only show as a recorded fallback to a slower kernel. ptxas's report is read too: the
configurations the kernels are designed around must not spill registers (docs/kda-kernels.md sections 4 and 5)."""
import itertools
import logging
import re

import pytest

from kda_compile.ops import _nvrtc
from kda_compile.ops.dsa.pooled import cuda_keys_source as dsa_pool_rows
from kda_compile.ops.dsa.indexer import cuda_topk
from kda_compile.ops.dsa.indexer import wgmma_indexer_source as dsa_indexer
from kda_compile.ops.dsa.sparse import wgmma_forward_source as dsa_sparse
from kda_compile.ops.kda.prefill.cuda import chunk_plan as cuda_chunk_plan
from kda_compile.ops.kda.prefill.cuda import prepare_source as prepare
from kda_compile.ops.kda.prefill.cuda import scan_source as scan
from kda_compile.ops.mla.decode import wgmma_decode_source as mla


def _nvrtc_missing() -> str | None:
    try:
        _nvrtc.nvrtc_library()
        return None
    except (_nvrtc.NvrtcUnavailable, OSError) as exc:
        return str(exc)[:200]


pytestmark = pytest.mark.skipif(_nvrtc_missing() is not None, reason=f"NVRTC not found: {_nvrtc_missing()}")


def _compile(source: str, name: str, arch: str, caplog) -> dict:
    """Compile with ptxas's report; its spill numbers."""
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="kda_compile.ops"):
        cubin = _nvrtc.compile_cubin(source, name, arch, ("--ptxas-options=-v",))
    assert len(cubin) > 1000 and name.encode() in cubin
    report = caplog.text
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills, f"no ptxas report for {name}:\n{report}"
    return {"stores": int(spills[0][0]), "loads": int(spills[0][1])}


PREPARE_FLAGS = list(itertools.product(("bf16", "f32"), (True, False), (True, False)))


@pytest.mark.parametrize("g_dtype, varlen, save_akk", PREPARE_FLAGS)
def test_kda_prepare_kernel_compiles(g_dtype, varlen, save_akk, caplog):
    source = prepare.kernel_source(g_dtype=g_dtype, beta_dtype=g_dtype, cu_dtype="long long" if varlen else "int",
                                   varlen=varlen, l2norm=True, has_a_log=True, has_dt_bias=True, beta_sigmoid=True,
                                   save_akk=save_akk)
    for arch in ("80", "90a"):
        spills = _compile(source, prepare.KERNEL_NAME, arch, caplog)
        if arch == "90a" and g_dtype == "bf16":  # the benchmark's configuration (bf16 gate), inference and training
            assert spills == {"stores": 0, "loads": 0}, spills


@pytest.mark.parametrize("gate", ["softplus", "wide-lower-bound"])
@pytest.mark.parametrize("g_dtype, varlen, save_akk",
                         [("bf16", True, False), ("bf16", False, True), ("f32", True, False)])
def test_kda_prepare_kernel_compiles_for_wide_blocks(gate, g_dtype, varlen, save_akk, caplog):
    """The per-channel forms for gates of any strength (``wide_blocks``): no spills on the H100 with a bf16 gate."""
    source = prepare.kernel_source(g_dtype=g_dtype, beta_dtype=g_dtype, cu_dtype="long long" if varlen else "int",
                                   varlen=varlen, l2norm=True, has_a_log=True, has_dt_bias=True, beta_sigmoid=True,
                                   save_akk=save_akk, softplus_gate=gate == "softplus", wide_blocks=True)
    for arch in ("80", "90a"):
        spills = _compile(source, prepare.KERNEL_NAME, arch, caplog)
        if arch == "90a" and g_dtype == "bf16":
            assert spills == {"stores": 0, "loads": 0}, spills


@pytest.mark.parametrize("form", ["lower-bound", "softplus", "gdn"])
def test_prepare_kernel_without_a_chunk_plan_compiles(form, caplog):
    """The ``inline_offsets`` form (packed sequences found from ``cu_seqlens`` alone): no spills with a bf16 gate."""
    source = prepare.kernel_source(g_dtype="bf16", beta_dtype="bf16", cu_dtype="int", varlen=True, l2norm=True,
                                   has_a_log=True, has_dt_bias=True, beta_sigmoid=True, save_akk=False,
                                   scalar_gate=form == "gdn", row_factors=form == "gdn",
                                   softplus_gate=form == "softplus", wide_blocks=form == "softplus",
                                   inline_offsets=True)
    assert "#define INLINE_OFFSETS 1" in source
    assert _compile(source, prepare.KERNEL_NAME, "90a", caplog) == {"stores": 0, "loads": 0}


def test_gate_form_options_are_checked():
    base = dict(g_dtype="bf16", beta_dtype="bf16", cu_dtype="int", varlen=False, l2norm=True, has_a_log=True,
                has_dt_bias=True, beta_sigmoid=True, save_akk=False)
    with pytest.raises(ValueError, match="softplus_gate needs wide_blocks"):
        prepare.kernel_source(**base, softplus_gate=True)
    with pytest.raises(ValueError, match="forms of the per-channel gate"):
        prepare.kernel_source(**base, scalar_gate=True, wide_blocks=True)


GDN_PREPARE_FLAGS = [("bf16", False, True), ("bf16", True, True), ("bf16", True, False), ("f32", False, True)]


@pytest.mark.parametrize("row_factors", [False, True])
@pytest.mark.parametrize("g_dtype, varlen, in_kernel_gate", GDN_PREPARE_FLAGS)
def test_gdn_prepare_kernel_compiles(g_dtype, varlen, in_kernel_gate, row_factors, caplog):
    """The scalar-gate form (GDN) of the prepare kernel, writing ``qg`` / ``kd`` tiles or the rows' factors: no
    spills on either GPU (at most 168 registers, NVRTC 12.9)."""
    source = prepare.kernel_source(g_dtype=g_dtype, beta_dtype=g_dtype, cu_dtype="long long" if varlen else "int",
                                   varlen=varlen, l2norm=True, has_a_log=in_kernel_gate, has_dt_bias=in_kernel_gate,
                                   beta_sigmoid=True, save_akk=False, scalar_gate=True, row_factors=row_factors)
    for arch in ("80", "90a"):
        spills = _compile(source, prepare.KERNEL_NAME, arch, caplog)
        assert spills == {"stores": 0, "loads": 0}, (arch, spills)


def test_row_factors_need_the_scalar_gate():
    with pytest.raises(ValueError, match="row_factors needs scalar_gate"):
        prepare.kernel_source(g_dtype="bf16", beta_dtype="bf16", cu_dtype="int", varlen=False, l2norm=True,
                              has_a_log=True, has_dt_bias=True, beta_sigmoid=True, save_akk=False, row_factors=True)


@pytest.mark.parametrize("row_factors", [False, True])
@pytest.mark.parametrize("block_v", scan.BLOCK_VS)
@pytest.mark.parametrize("varlen, has_h0, store_ht", [(False, True, True), (True, True, True), (True, False, False)])
def test_kda_scan_kernel_compiles(block_v, varlen, has_h0, store_ht, row_factors, caplog):
    source = scan.kernel_source(cu_dtype="int", varlen=varlen, has_h0=has_h0, store_ht=store_ht, stages=2,
                                block_v=block_v, row_factors=row_factors)
    spills = _compile(source, scan.KERNEL_NAME, "90a", caplog)
    if block_v > 32:  # 32 columns a CTA take 255 registers and spill 4 bytes in some specialisations (NVRTC 12.9)
        assert spills == {"stores": 0, "loads": 0}, spills


@pytest.mark.parametrize("cu_type", ["int", "long long"])
def test_chunk_plan_kernel_compiles(cu_type, caplog):
    _compile(cuda_chunk_plan._source(cu_type), cuda_chunk_plan.KERNEL_NAME, "80", caplog)


@pytest.mark.parametrize("partial", [False, True])
def test_mla_decode_kernel_compiles(partial, caplog):
    source = mla.kernel_source(elem="bf16", is_causal=True, mask_kind=0, partial=partial)
    _compile(source, mla.KERNEL_NAME, "90a", caplog)


@pytest.mark.parametrize("elem, rope, partial", [("bf16", True, False), ("bf16", True, True), ("bf16", False, False),
                                                 ("bf16", False, True), ("f16", True, False)])
def test_dsa_sparse_attention_kernel_compiles_without_spills(elem, rope, partial, caplog):
    source = dsa_sparse.kernel_source(elem=elem, rope=rope, partial=partial)
    assert _compile(source, dsa_sparse.KERNEL_NAME, "90a", caplog) == {"stores": 0, "loads": 0}


# ---- the on-disk cubin cache ------------------------------------------------------------------------------
def _small_source(value: int) -> str:
    source = cuda_chunk_plan._source("int").replace("chunk_offsets[0] = 0;", f"chunk_offsets[0] = {value};")
    assert f"chunk_offsets[0] = {value};" in source
    return source


def test_cubins_are_kept_on_disk_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv(_nvrtc.CACHE_DIR_ENV, str(tmp_path))
    first, path = _nvrtc.cached_cubin(_small_source(0), cuda_chunk_plan.KERNEL_NAME, "90a")
    assert path is None and len(list((tmp_path / "nvrtc").iterdir())) == 1

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled although the cubin is on disk")
    monkeypatch.setattr(_nvrtc, "compile_cubin", no_compiler)
    again, path = _nvrtc.cached_cubin(_small_source(0), cuda_chunk_plan.KERNEL_NAME, "90a")
    assert again == first and path is not None and path.startswith(str(tmp_path))


def test_each_source_and_arch_has_its_own_cubin(tmp_path, monkeypatch):
    monkeypatch.setenv(_nvrtc.CACHE_DIR_ENV, str(tmp_path))
    for value, arch in ((0, "90a"), (1, "90a"), (0, "80")):
        _, path = _nvrtc.cached_cubin(_small_source(value), cuda_chunk_plan.KERNEL_NAME, arch)
        assert path is None
    assert len(list((tmp_path / "nvrtc").iterdir())) == 3


def test_a_damaged_cubin_is_compiled_again(tmp_path, monkeypatch):
    monkeypatch.setenv(_nvrtc.CACHE_DIR_ENV, str(tmp_path))
    good, _ = _nvrtc.cached_cubin(_small_source(0), cuda_chunk_plan.KERNEL_NAME, "90a")
    (cached,) = (tmp_path / "nvrtc").iterdir()
    cached.write_bytes(b"not a cubin")
    again, path = _nvrtc.cached_cubin(_small_source(0), cuda_chunk_plan.KERNEL_NAME, "90a")
    assert path is None and again == good and cached.read_bytes() == good


def test_the_cache_can_be_switched_off_or_unwritable(tmp_path, monkeypatch):
    monkeypatch.setenv(_nvrtc.CACHE_DIR_ENV, "")
    assert _nvrtc.cubin_cache_dir() is None
    cubin, path = _nvrtc.cached_cubin(_small_source(0), cuda_chunk_plan.KERNEL_NAME, "90a")
    assert path is None and cubin.startswith(b"\x7fELF")
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv(_nvrtc.CACHE_DIR_ENV, str(blocker))
    cubin, path = _nvrtc.cached_cubin(_small_source(0), cuda_chunk_plan.KERNEL_NAME, "90a")
    assert path is None and cubin.startswith(b"\x7fELF")


@pytest.mark.parametrize("per", cuda_topk.PER_THREAD)
def test_dsa_topk_kernel_compiles(per, caplog):
    """The DSA top-k's kernel at each per-thread width and CTA size, one CTA per row (any GPU) or a cluster of two
    (sm_90): no spills on the H100."""
    for threads in (cuda_topk.THREADS, 2 * cuda_topk.THREADS):
        for arch, cluster in (("80", 1), ("90a", 1), ("90a", 2)):
            spills = _compile(cuda_topk.kernel_source(per, cluster, threads), cuda_topk.KERNEL_NAME, arch, caplog)
            if arch == "90a":
                assert spills == {"stores": 0, "loads": 0}, spills


@pytest.mark.parametrize("elem, has_key_mask, weight",
                         list(itertools.product(("bf16", "f16"), (False, True), dsa_indexer.WEIGHT_KINDS)))
def test_dsa_indexer_kernel_compiles_without_spills(elem, has_key_mask, weight, caplog):
    source = dsa_indexer.kernel_source(elem=elem, has_key_mask=has_key_mask, weight=weight)
    assert _compile(source, dsa_indexer.KERNEL_NAME, "90a", caplog) == {"stores": 0, "loads": 0}


def test_dsa_indexer_source_options_are_checked():
    with pytest.raises(ValueError, match="weight must be one of"):
        dsa_indexer.kernel_source(elem="bf16", has_key_mask=False, weight="f64")
    with pytest.raises(ValueError, match="stages must be 2 to 8, got 1"):
        dsa_indexer.kernel_source(elem="bf16", has_key_mask=False, stages=1)
    with pytest.raises(ValueError, match="elem must be 'bf16' or 'f16'"):
        dsa_indexer.kernel_source(elem="f32", has_key_mask=False)


POOL_ROWS_FORMS = [(e, s, m, 128, 16, True) for e in ("bf16", "f16")
                   for s, m in ((1, 0), (1, 1), (1, 2), (2, 0), (2, 1))]


@pytest.mark.parametrize("elem, spans, mask, channels, pool, pairs",
                         POOL_ROWS_FORMS + [("bf16", 1, 2, 128, 16, False), ("bf16", 1, 2, 256, 32, False),
                                            ("bf16", 1, 2, 256, 16, True),
                                            ("f16", 2, 1, 96, 3, False), ("bf16", 1, 0, 32, 1, False)])
def test_dsa_pool_rows_kernel_compiles_without_spills(elem, spans, mask, channels, pool, pairs, caplog):
    """glm5_next's pool-forming kernels over whole token rows: every width and pool size they take compiles for
    sm_80 and sm_90a without spills (wide pools read the position bias through the L1 instead of registers)."""
    source = dsa_pool_rows.kernel_source(elem=elem, pool=pool, channels=channels, spans=spans, mask=mask,
                                         pairs=pairs)
    names = (dsa_pool_rows.KERNEL_NAME, dsa_pool_rows.FIRST_NAME) if mask == dsa_pool_rows.MASK_FLAGS else \
        (dsa_pool_rows.KERNEL_NAME,)
    for arch in ("80", "90a"):
        for name in names:
            assert _compile(source, name, arch, caplog) == {"stores": 0, "loads": 0}


def test_dsa_pool_rows_source_options_are_checked():
    with pytest.raises(ValueError, match="elem='f32'"):
        dsa_pool_rows.kernel_source(elem="f32", pool=16, channels=128, spans=1, mask=1)
    with pytest.raises(ValueError, match="pool=33"):
        dsa_pool_rows.kernel_source(elem="bf16", pool=33, channels=128, spans=1, mask=1)
    with pytest.raises(ValueError, match="channels=100"):
        dsa_pool_rows.kernel_source(elem="bf16", pool=16, channels=100, spans=1, mask=1)
    with pytest.raises(ValueError, match="spans=3"):
        dsa_pool_rows.kernel_source(elem="bf16", pool=16, channels=128, spans=3, mask=1)
    with pytest.raises(ValueError, match="pairs with channels=96"):
        dsa_pool_rows.kernel_source(elem="bf16", pool=16, channels=96, spans=1, mask=1, pairs=True)
    with pytest.raises(ValueError, match="mask=2 with spans=2"):
        dsa_pool_rows.kernel_source(elem="bf16", pool=16, channels=128, spans=2, mask=2)
