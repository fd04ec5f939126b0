"""The parameter blocks our NVRTC kernels are launched with (ops/_nvrtc.py ``ArgumentBlock``): the address array
``cuLaunchKernel`` reads must point at each pointer slot and each scalar, and ``set_pointers`` must rewrite every
slot, and only the slots, on every call. Host memory only: no GPU or driver needed."""
import ctypes

import pytest

from kda_compile.ops._nvrtc import ArgumentBlock


def _parameters(block: ArgumentBlock, types) -> list:
    """The values the driver would read: parameter i at ``block.array[i]``, read as ``types[i]``."""
    return [kind.from_address(block.array[i]).value for i, kind in enumerate(types)]


def test_pointer_slots_and_scalars_are_read_where_the_array_points():
    scalars = [ctypes.c_int(-7), ctypes.c_float(0.5), ctypes.c_longlong(2**40 + 3)]
    block = ArgumentBlock(3, scalars)
    types = [ctypes.c_uint64] * 3 + [ctypes.c_int, ctypes.c_float, ctypes.c_longlong]
    assert len(block.array) == 6
    assert _parameters(block, types) == [0, 0, 0, -7, 0.5, 2**40 + 3]
    for addresses in [(1, 2, 3), (2**64 - 1, 0, 0x7F00_1234_5678), (0xDEAD_BEEF_0000, 2**48, 5)]:
        block.set_pointers(addresses)
        assert _parameters(block, types) == [*addresses, -7, 0.5, 2**40 + 3]


def test_a_block_without_scalars_or_pointers():
    block = ArgumentBlock(2, [])
    block.set_pointers((10, 20))
    assert _parameters(block, [ctypes.c_uint64] * 2) == [10, 20]
    only_scalars = ArgumentBlock(0, [ctypes.c_int(4)])
    only_scalars.set_pointers(())
    assert _parameters(only_scalars, [ctypes.c_int]) == [4]


def test_the_wrong_number_of_pointers_is_an_error():
    block = ArgumentBlock(3, [ctypes.c_int(1)])
    with pytest.raises(Exception, match="3"):
        block.set_pointers((1, 2))
    with pytest.raises(Exception, match="3"):
        block.set_pointers((1, 2, 3, 4))
