"""The one description of each prefill CUDA kernel's launch (ops/kda/prefill/cuda/launch.py), which the ordinary
launchers and the fast path's plans both read: its parameter list is the kernel's signature in its .cu file
(pointers first, then the scalars with their C types, in order), and the per-call parameter list and the plan's
argument block it builds hold the same values. Host memory only: no GPU, driver or NVRTC needed."""
import ctypes
import re

import pytest

from kda_compile.ops._nvrtc import cuda_source
from kda_compile.ops.kda.prefill.cuda import launch

PACKAGE = "kda_compile.ops.kda.prefill.cuda"
_C_TYPES = {"int": ctypes.c_int, "float": ctypes.c_float, "long long": ctypes.c_longlong}
DESCRIPTIONS = [launch.PREPARE, launch.SCAN, launch.CHUNK_PLAN]


def _signature(description) -> list:
    """The kernel's parameters in its source: "pointer" or the ctypes type of each scalar, in order."""
    text = cuda_source(PACKAGE, description.source)
    found = re.search(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?' + description.kernel
                      + r"\(([^)]*)\)", text)
    assert found, f"no kernel {description.kernel} in {description.source}"
    kinds = []
    for parameter in found.group(1).split(","):
        words = parameter.replace("__restrict__", "").replace("const", "").split()
        kinds.append("pointer" if "*" in parameter else _C_TYPES[" ".join(words[:-1])])
    return kinds


@pytest.mark.parametrize("description", DESCRIPTIONS, ids=lambda d: d.kernel)
def test_the_description_is_the_kernels_signature(description):
    expected = ["pointer"] * len(description.pointers) + [kind for _, kind in description.scalars]
    assert _signature(description) == expected


@pytest.mark.parametrize("description", DESCRIPTIONS, ids=lambda d: d.kernel)
def test_a_launchs_parameters_and_a_plans_block_hold_the_same_values(description):
    scalars = {name: 3 + i for i, (name, _) in enumerate(description.scalars)}
    pointers = [0x7F00_0000_0000 + 256 * i for i in range(len(description.pointers))]
    params = description.params(pointers, scalars)
    block = description.block(scalars)
    block.set_pointers(pointers)
    kinds = [ctypes.c_uint64] * len(pointers) + [kind for _, kind in description.scalars]
    from_block = [kind.from_address(block.array[i]).value for i, kind in enumerate(kinds)]
    assert [p.value for p in params] == from_block == pointers + [scalars[name] for name, _ in description.scalars]
    with pytest.raises(ValueError, match=f"takes {len(pointers)} pointers"):
        description.params(pointers[1:], scalars)


def test_grids_blocks_and_shared_memory():
    assert launch.PREPARE.grid(7, 32) == (7, 32, 1) and launch.PREPARE.threads() == 128
    for block_v in (32, 64, 128):
        assert launch.SCAN.grid(block_v, 32, 5) == (128 // block_v, 32, 5)
        assert launch.SCAN.threads(block_v) == 32 * (block_v // 16)  # the kernel's 32 * WARPS
    assert launch.CHUNK_PLAN.grid() == (1, 1, 1) and launch.CHUNK_PLAN.shared_bytes() == 0
    assert 3 * (launch.PREPARE.shared_bytes() + 1024) <= 228 * 1024  # three CTAs an SM (sm_90's shared memory)
