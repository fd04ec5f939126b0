"""kda_compile.ops._nvrtc.cuda_source: CUDA sources read as package data, local includes inlined once."""
import sys

import pytest

from kda_compile.ops._nvrtc import cuda_source


@pytest.fixture
def package(tmp_path, monkeypatch):
    root = tmp_path / "cuda_pkg_for_test"
    (root / "common").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "common" / "__init__.py").write_text("")
    (root / "common" / "math.cuh").write_text('#pragma once\n__device__ float twice(float x) { return 2 * x; }\n')
    (root / "tile.cuh").write_text('#include "common/math.cuh"\n__device__ float tile(float x) { return twice(x); }\n')
    (root / "kernel.cu").write_text('#include <cuda_fp16.h>\n#include "tile.cuh"\n#include "common/math.cuh"\n'
                                    'extern "C" __global__ void k(float* x) { x[0] = tile(x[0]); }\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "cuda_pkg_for_test"
    cuda_source.cache_clear()
    sys.modules.pop("cuda_pkg_for_test", None)


def test_local_includes_are_inlined_once_and_system_includes_kept(package):
    text = cuda_source(package, "kernel.cu")
    assert text.count("__device__ float twice") == 1, text
    assert text.index("twice(float x)") < text.index("tile(float x)") < text.index("__global__")
    assert "#include <cuda_fp16.h>" in text and '#include "' not in text


def test_a_missing_source_names_the_file_and_the_package(package, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'absent.cu'.*'cuda_pkg_for_test'"):
        cuda_source(package, "absent.cu")
    (tmp_path / package / "bad.cu").write_text('#include "gone.cuh"\n')
    with pytest.raises(FileNotFoundError, match=r"'gone.cuh'"):
        cuda_source(package, "bad.cu")


def test_the_kernels_chunk_count_is_the_chunk_of_the_host_plans():
    """``chunk_count.cuh`` spells out ``CHUNK``: the CUDA kernels and the host plans count a sequence's chunks alike."""
    from kda_compile.ops.kda.prefill.chunks import CHUNK

    text = cuda_source("kda_compile.ops.kda.prefill.cuda", "chunk_count.cuh")
    assert text.count(f"+ {CHUNK - 1}) / {CHUNK}") == 2, text


def test_an_include_that_climbs_reads_the_parent_package(package, tmp_path):
    """``../`` steps up to the parent package: helpers shared by several ops' kernels live in one package."""
    (tmp_path / package / "op").mkdir()
    (tmp_path / package / "op" / "__init__.py").write_text("")
    (tmp_path / package / "op" / "uses.cu").write_text('#include "../common/math.cuh"\n#include "../tile.cuh"\n'
                                                       '__global__ void u(float* x) { x[0] = tile(x[0]); }\n')
    text = cuda_source(f"{package}.op", "uses.cu")
    assert text.count("__device__ float twice") == 1 and text.index("twice(float") < text.index("tile(float"), text
    with pytest.raises(FileNotFoundError, match=r"climbs above"):
        (tmp_path / package / "op" / "up.cu").write_text('#include "../../x.cuh"\n')
        cuda_source(f"{package}.op", "up.cu")
