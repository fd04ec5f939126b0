"""The launchers' host-side integer helpers (ops/_common.py) agree with triton's, which they replace on the
decode hot path (Triton 3.6's are constexpr functions, microseconds per call)."""
import pytest

from kda_compile.ops._common import cdiv, next_power_of_2


def test_next_power_of_2_matches_triton():
    triton = pytest.importorskip("triton")
    for n in [-3, *range(0, 300), 511, 512, 513, 2**20 - 1, 2**20, 2**31 + 5]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def test_cdiv_matches_triton():
    triton = pytest.importorskip("triton")
    for a in [0, 1, 2, 15, 16, 17, 63, 64, 65, 4095, 4096, 4097, 2**40 + 3]:
        for b in (1, 2, 16, 64, 100):
            assert cdiv(a, b) == triton.cdiv(a, b) == -(-a // b), (a, b)
