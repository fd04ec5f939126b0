"""The chunk of the KDA / GDN prefill kernels, and how a call's chunks are counted.

Every prefill kernel, Triton and CUDA, works on chunks of ``CHUNK`` tokens (the prepare kernels' four 16-row
sub-blocks). A sequence of ``n`` tokens has ``ceil(n / CHUNK)`` chunks, an empty one none. Packed sequences number
their chunks densely, sequence after sequence: a program (or CTA) per chunk slot finds its sequence from these counts.

The count is written once per language, here: ``first_chunk_slots`` for PyTorch (host plans, the Triton path) and
``chunk_count`` in ``chunk_count.cuh``, the device function the CUDA kernels include (the chunk plan, our prepare
and scan; it spells ``CHUNK`` out, a test keeps the two equal).
"""
from __future__ import annotations

import torch

from kda_compile.ops._common import cdiv

CHUNK = 64

def chunks_in(tokens: int) -> int:
    """Chunks of one sequence of ``tokens`` tokens."""
    return cdiv(tokens, CHUNK)


def packed_slot_bound(T: int, N: int) -> int:
    """Chunk slots that cover ``N`` packed sequences of ``T`` tokens in all, without reading their offsets: each
    sequence's last, partial chunk adds at most one to ``ceil(T / CHUNK)``. Slots past the real count exit at once."""
    return chunks_in(T) + N


def first_chunk_slots(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[N + 1]`` int32: the first chunk slot of each of the ``N`` sequences of ``cu_seqlens``, and the total.
    Offsets are not checked here (``check_inputs`` rejects decreasing ones)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    offsets = torch.zeros(cu_seqlens.shape[0], dtype=torch.int32, device=cu_seqlens.device)
    torch.cumsum((lengths + CHUNK - 1) // CHUNK, 0, out=offsets[1:])
    return offsets
