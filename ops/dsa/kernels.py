"""Which implementation runs a DSA op on CUDA: our CUDA / Triton kernels, or (logged) the torch reference.

The sparse attention forward runs the Hopper wgmma kernel (``sparse/wgmma_forward.py``) on the calls it is written for
(sm_90, half precision, the absorbed form with 512 (+ 64) channel rows; ``wgmma_forward.choose_kernel``), the
Triton kernel otherwise.

Kernels know nothing of torch.compile; this module only checks that a call fits them (dtype, head
widths the tiles handle, Triton importable): each op's kernels are a menu (``ops/_kernel_choice.py``), which records
every fallback with its reason. The values of a CUDA
``cu_seqlens`` are read on the host only when ``KDA_COMPILE_CHECK_INPUTS`` asks for value checks (a device sync
per call otherwise; KDA's rule, docs/kda-input-checks.md): unchecked offsets that are not offsets from 0 to T give
an in-range, meaningless selection (``reference.visible_ranges`` clamps every range to the keys), never an
out-of-range access.
"""
from __future__ import annotations

import functools

import torch

from kda_compile.ops import envs
from kda_compile.ops._common import module_unusable
from kda_compile.ops._kernel_choice import Kernel, KernelMenu
from kda_compile.ops._nvrtc import NvrtcUnavailable
from kda_compile.ops.dsa.sparse import wgmma_forward
from kda_compile.ops.dsa.pooled.reference import pooled_indexer_topk_reference
from kda_compile.ops.dsa.reference import (
    check_cu_seqlens_values,
    indexer_topk_reference,
    sparse_attention_backward_reference,
    sparse_attention_reference,
)

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_INDEXER_DIM = 256  # one key tile holds the whole indexer head dim
MAX_QK_TILE = 640  # padded query/key width the attention tiles are sized for (576 = 512 + 64 in DeepSeek-V3.2)
MAX_VALUE_DIM = 512


@functools.lru_cache(maxsize=None)
def _unusable(module: str) -> str | None:
    return module_unusable(module)


def _why_not_indexer(q, k, module: str = "kda_compile.ops.dsa.indexer.triton_indexer") -> str | None:
    """Why the token-level (or, with ``module``, the pooled) indexer kernel cannot take q / k, or None."""
    why = _unusable(module)
    if why:
        return why
    if q.dtype not in _TRITON_DTYPES or k.dtype not in _TRITON_DTYPES:
        return f"{q.dtype} inputs have no Triton kernel"
    if q.shape[-1] > MAX_INDEXER_DIM:
        return f"indexer head dim {q.shape[-1]} > {MAX_INDEXER_DIM}"
    return None


def _why_not_attention(q, k, v, d_v) -> str | None:
    why = _unusable("kda_compile.ops.dsa.sparse.triton_forward")
    if why:
        return why
    dtypes = {t.dtype for t in (q, k, v) if t is not None}
    if not dtypes <= set(_TRITON_DTYPES):
        return f"{sorted(map(str, dtypes))} inputs have no Triton kernel"
    from kda_compile.ops.dsa.sparse.triton_forward import head_widths

    _, block_main, d_tail, block_tail = head_widths(q.shape[-1])
    padded = block_main + (block_tail if d_tail else 0)
    if padded > MAX_QK_TILE or d_v > MAX_VALUE_DIM:
        return (f"head widths d_qk {q.shape[-1]} (tiles {padded} wide) / d_v {d_v} exceed the kernels' "
                f"{MAX_QK_TILE} / {MAX_VALUE_DIM}")
    return None


def _reference(label: str = "torch reference") -> Kernel:
    return Kernel("reference", label)


INDEXER = KernelMenu("dsa_indexer_topk", (
    Kernel("triton", "Triton indexer kernel", cannot_run=lambda q, k: _why_not_indexer(q, k)), _reference()))
POOLED_INDEXER = KernelMenu("dsa_pooled_indexer_topk", (
    Kernel("triton", "Triton pooled indexer kernel",
           cannot_run=lambda q, k: _why_not_indexer(q, k, "kda_compile.ops.dsa.pooled.triton_indexer")),
    _reference()))
SPARSE_ATTENTION = KernelMenu("dsa_sparse_attention", (
    Kernel("triton", "Triton sparse attention kernel", cannot_run=_why_not_attention), _reference()))
SPARSE_ATTENTION_BACKWARD = KernelMenu("dsa_sparse_attention_backward", (
    Kernel("triton", "Triton sparse attention backward kernel",
           cannot_run=lambda q, k, v, d_v: (_why_not_attention(q, k, v, d_v)
                                            or _unusable("kda_compile.ops.dsa.sparse.triton_backward"))),
    _reference("torch blockwise reference")))


def indexer_topk_cuda(q, k, weights, key_mask, cu_seqlens, topk, scale, is_causal):
    if INDEXER.choose(q, k).name == "reference":
        return indexer_topk_reference(q, k, weights, key_mask, cu_seqlens, topk, scale, is_causal)
    from kda_compile.ops.dsa.indexer.triton_indexer import indexer_topk_triton

    if cu_seqlens is not None and envs.check_inputs():
        check_cu_seqlens_values(cu_seqlens, k.shape[1])
    return indexer_topk_triton(q, k, weights, key_mask, cu_seqlens, topk, scale, is_causal)


def pooled_indexer_topk_cuda(q, k, gate, weights, key_valid, ape, query_mask, topk, scale, q_offset, select_tail):
    args = (q, k, gate, weights, key_valid, ape, query_mask, topk, scale, q_offset, select_tail)
    if POOLED_INDEXER.choose(q, k).name == "reference":
        return pooled_indexer_topk_reference(*args)
    from kda_compile.ops.dsa.pooled.triton_indexer import pooled_indexer_topk_triton

    return pooled_indexer_topk_triton(*args)


def sparse_attention_fwd_cuda(q, k, v, indices, scale, d_v):
    if SPARSE_ATTENTION.choose(q, k, v, d_v).name == "reference":
        o, lse = sparse_attention_reference(q, k, v, indices, scale, d_v)
        return o.to(q.dtype).contiguous(), lse.contiguous()
    from kda_compile.ops.dsa.sparse.triton_forward import sparse_attention_fwd_triton

    if wgmma_forward.choose_kernel(q, k, v, indices, d_v) == "cuda":
        try:
            return wgmma_forward.sparse_attention_fwd_wgmma(q, k, indices, scale)
        except NvrtcUnavailable as exc:
            wgmma_forward.record_unavailable(exc)
    return sparse_attention_fwd_triton(q, k, v, indices, scale, d_v)


def sparse_attention_bwd_cuda(grad_o, grad_lse, q, k, v, indices, o, lse, scale, d_v):
    if SPARSE_ATTENTION_BACKWARD.choose(q, k, v, d_v).name == "reference":
        return sparse_attention_backward_reference(grad_o, grad_lse, q, k, v, indices, scale, d_v)
    from kda_compile.ops.dsa.sparse.triton_backward import sparse_attention_bwd_triton

    return sparse_attention_bwd_triton(grad_o, grad_lse, q, k, v, indices, o, lse, scale, d_v)
