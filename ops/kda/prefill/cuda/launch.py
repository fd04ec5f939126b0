"""How each CUDA kernel of the KDA / GDN prefill is launched, described once: its grid, its block, its dynamic
shared memory and its parameter list (the pointer parameters first, in the kernel's order, then the scalars with
their C types).

Two launchers read these descriptions: the ordinary path's (``prepare.launch_prepare``, ``scan.launch_scan_cuda``),
which builds a parameter list per call, and the fast path's plans (``fast_path.Plan``), which build an
``_nvrtc.ArgumentBlock`` once per call signature and rewrite only its pointers per call. Both pass the pointers in
``pointers`` order. A change to a kernel's signature (its ``.cu`` file) changes the description here, and only here;
tests/kda/test_launch_descriptions.py reads each kernel's signature from its source and checks it against these.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from kda_compile.ops._nvrtc import ArgumentBlock
from kda_compile.ops.kda.prefill.cuda import chunk_plan, prepare_source, scan_source


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel's launch: ``grid(...)`` and ``threads(...)`` from the launch's sizes, ``shared_bytes(...)`` its
    dynamic shared memory (what the kernel is loaded with), ``pointers`` / ``scalars`` its parameters in order."""

    kernel: str
    source: str  # the .cu file beside these modules
    pointers: tuple[str, ...]
    scalars: tuple[tuple[str, type], ...]
    grid: Callable[..., tuple[int, int, int]]
    threads: Callable[..., int]
    shared_bytes: Callable[..., int]

    def _scalar_values(self, values: Mapping) -> list:
        return [kind(values[name]) for name, kind in self.scalars]

    def params(self, pointers: Sequence[int], scalars: Mapping) -> list:
        """The ctypes parameter list of one launch (``CompiledKernel.launch``): ``pointers`` the device addresses in
        ``self.pointers`` order, ``scalars`` a mapping holding at least every name of ``self.scalars``."""
        if len(pointers) != len(self.pointers):
            raise ValueError(f"{self.kernel} takes {len(self.pointers)} pointers ({', '.join(self.pointers)}), "
                             f"got {len(pointers)}")
        return [ctypes.c_void_p(p) for p in pointers] + self._scalar_values(scalars)

    def block(self, scalars: Mapping) -> ArgumentBlock:
        """An ``ArgumentBlock`` with the scalars set once; its pointers are set per call (``set_pointers``, in
        ``self.pointers`` order)."""
        return ArgumentBlock(len(self.pointers), self._scalar_values(scalars))


_INT, _FLOAT, _LONG = ctypes.c_int, ctypes.c_float, ctypes.c_longlong

# One CTA per (chunk slot, value head). ``qg`` holds the rows' factors and ``kd`` is not written in the
# ``ROW_FACTORS`` form; ``a_kk`` is written with ``SAVE_AKK``; ``cu_seqlens`` / ``chunk_offsets`` are read with packed
# sequences (``chunk_offsets`` only without ``INLINE_OFFSETS``): a launch passes any valid address for the others.
PREPARE = KernelLaunch(
    kernel=prepare_source.KERNEL_NAME, source="prepare.cu",
    pointers=("q", "k", "v", "g", "beta", "a_log", "dt_bias", "w", "u", "qg", "kd", "a_qk", "decay", "a_kk",
              "cu_seqlens", "chunk_offsets"),
    scalars=(("T", _INT), ("N", _INT), ("H", _INT), ("HV", _INT), ("scale", _FLOAT), ("beta_scale", _FLOAT),
             ("lower_bound", _FLOAT)),
    grid=lambda slots, HV: (slots, HV, 1),
    threads=lambda: prepare_source.THREADS,
    shared_bytes=lambda: prepare_source.SHARED_BYTES,
)

# One CTA of block_v / 16 warps per (value block, value head, sequence). ``h0`` / ``ht`` are read / written with an
# initial / final state, ``fact`` (the rows' factors) in the ``ROW_FACTORS`` form, where ``qg`` / ``kd`` are the raw
# q / k; ``H`` is the q / k head count there (else HV).
SCAN = KernelLaunch(
    kernel=scan_source.KERNEL_NAME, source="scan.cu",
    pointers=("w", "u", "qg", "kd", "a_qk", "decay", "o", "h0", "ht", "cu_seqlens", "chunk_offsets", "fact"),
    scalars=(("T", _INT), ("HV", _INT), ("H", _INT), ("h0_sn", _LONG), ("h0_sh", _LONG), ("h0_sk", _LONG),
             ("h0_sv", _LONG)),
    grid=lambda block_v, HV, N: (scan_source.HEAD_DIM // block_v, HV, N),
    threads=lambda block_v: 2 * block_v,
    shared_bytes=scan_source.shared_bytes,
)

# One block for every sequence (a tile of lengths at a time).
CHUNK_PLAN = KernelLaunch(
    kernel=chunk_plan.KERNEL_NAME, source="chunk_plan.cu",
    pointers=("cu_seqlens", "chunk_offsets"),
    scalars=(("N", _INT),),
    grid=lambda: (1, 1, 1),
    threads=lambda: chunk_plan.THREADS,
    shared_bytes=lambda: 0,
)


def scan_scalars(T: int, HV: int, H: int, h0_strides: Sequence[int]) -> dict:
    """``SCAN``'s scalars by name: the initial state's strides ``(sn, sh, sk, sv)`` in elements (zeros without one)."""
    sn, sh, sk, sv = h0_strides
    return {"T": T, "HV": HV, "H": H, "h0_sn": sn, "h0_sh": sh, "h0_sk": sk, "h0_sv": sv}
