"""Triton kernel forming glm5_next's pooled indexer keys: the softmax-gated pools of ``reference.pooled_keys`` in one
pass over the key cache.

Kernel and launcher only (no torch.compile, no dispatch). Pool ``p`` of batch row ``b`` holds the tokens
``first[b] + p * P + j`` (``j < P``); per channel ``d``::

    g[j, d] = softmax_j(gate[tok_j, d] + ape[j, d])       (float32; tokens past T or not valid excluded)
    pk[d]   = sum_j round_k(g[j, d]) * k[tok_j, d]          (each product rounded to k's dtype, summed in float32)

and the pool is valid when all ``P`` tokens exist and are valid. This is the reference's math (``torch``'s bf16
product, its float32 sum and the softmax of an all-excluded pool read as zeros); the float32 exponent and the
summation order may differ from torch's in the last bit. One program forms ``BLOCK_P`` pools of one row: it
reads their ``P x D`` keys and gates once (``2 * T * D`` elements per call in all), where the torch reference
runs about eight kernels per block of pools with ``[B, pools, P, D]`` float32 temporaries (docs/dsa.md, section 4,
"Tuning measurements", "pool keys").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kda_compile.ops._common import cdiv, next_power_of_2
from kda_compile.ops.dsa.pooled.reference import empty_pools
from kda_compile.ops.dsa.indexer.triton_indexer import interpreted


@triton.jit
def form_pools_kernel(
    K, Gate, KeyValid, Ape, First, PK, PoolValid,
    stride_kb, stride_kt, stride_kd,
    stride_gb, stride_gt, stride_gd,
    stride_vb, stride_vt,
    stride_ap, stride_ad,
    stride_pb, stride_pp, stride_pd,
    stride_qb, stride_qp,
    T, NP, D,
    POOL: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_KEY_VALID: tl.constexpr,
):
    """PK [B, NP, D] (k's dtype) and PoolValid [B, NP] (uint8) for pools ``BLOCK_P * pid + [0, BLOCK_P)`` of row
    ``b``. K / Gate [B, T, D], KeyValid [B, T] uint8, Ape [P, D], First [B] int64; all by strides. Without
    ``HAS_KEY_VALID`` every key is valid and the pools start at token 0 (KeyValid and First are not read).
    The key and gate tiles are loaded for every existing token, beside the validity bits rather than after them
    (one round trip fewer; invalid tokens are masked in registers). Grid (pool blocks, B)."""
    b = tl.program_id(1).to(tl.int64)
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    j = tl.arange(0, BLOCK_J)  # the pool's tokens, padded to a power of two
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    first = tl.load(First + b) if HAS_KEY_VALID else 0
    tok = first + p.to(tl.int64)[:, None] * POOL + j[None, :]
    exists = (tok < T) & (p < NP)[:, None] & (j < POOL)[None, :]
    safe = tl.where(exists, tok, 0)
    present = exists[:, :, None] & d_ok[None, None, :]
    gate = tl.load(Gate + b * stride_gb + safe[:, :, None] * stride_gt + d[None, None, :] * stride_gd,
                   mask=present, other=0.0).to(tl.float32)
    keys = tl.load(K + b * stride_kb + safe[:, :, None] * stride_kt + d[None, None, :] * stride_kd,
                   mask=present, other=0.0)
    if HAS_KEY_VALID:
        valid = exists & (tl.load(KeyValid + b * stride_vb + safe * stride_vt, mask=exists, other=0) != 0)
    else:
        valid = exists
    mask3 = valid[:, :, None] & d_ok[None, None, :]
    keys = tl.where(mask3, keys, 0.0)  # an invalid token's key (any bits, NaN included) takes no part
    ape = tl.load(Ape + j[:, None] * stride_ap + d[None, :] * stride_ad, mask=(j < POOL)[:, None] & d_ok[None, :],
                  other=0.0)
    logits = tl.where(mask3, gate + ape.to(tl.float32)[None, :, :], float("-inf"))
    m = tl.max(logits, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # an all-excluded pool: zeros, as the reference's nan_to_num
    e = tl.exp(logits - m[:, None, :])
    total = tl.sum(e, 1)
    probs = (e / tl.where(total > 0, total, 1.0)[:, None, :]).to(PK.dtype.element_ty)
    product = (probs.to(tl.float32) * keys.to(tl.float32)).to(PK.dtype.element_ty)  # k's dtype, as torch multiplies
    pk = tl.sum(product.to(tl.float32), 1)
    p_ok = p < NP
    tl.store(PK + b * stride_pb + p[:, None] * stride_pp + d[None, :] * stride_pd, pk.to(PK.dtype.element_ty),
             mask=p_ok[:, None] & d_ok[None, :])
    complete = tl.sum(valid.to(tl.int32), 1) == POOL
    tl.store(PoolValid + b * stride_qb + p * stride_qp, complete.to(tl.uint8), mask=p_ok)


def pooled_keys_triton(k, gate, key_valid, ape, first):
    """(pk [B, NP, D] in k's dtype, pool_valid bool [B, NP]): ``pooled.reference.pooled_keys`` in one kernel.

    k / gate [B, T, D] (any strides, floating), key_valid bool [B, T] or None (every key valid: the pools start at
    token 0 and ``first``, zeros, is not read), ape [P, D], first int64 [B]."""
    b, t_len, d = k.shape
    pool = ape.shape[0]
    pk, pool_valid = empty_pools(k, pool)
    n_pools = pk.shape[1]
    if b * n_pools == 0:
        return pk, pool_valid
    block_d = max(16, next_power_of_2(d))
    block_j = next_power_of_2(pool)
    # one warp per 2k-element tile (one pool of 16 x 128): faster than four pools on four warps, with or without a
    # key mask (docs/dsa.md, section 4, "Tuning measurements", "pool keys")
    block_p = 1 if interpreted() else max(1, 2048 // (block_j * block_d))
    has_valid = key_valid is not None
    valid_u8 = key_valid.view(torch.uint8) if has_valid else pool_valid.view(torch.uint8)  # (not read without)
    form_pools_kernel[(cdiv(n_pools, block_p), b)](
        k, gate, valid_u8, ape, first, pk, pool_valid.view(torch.uint8),
        *k.stride(), *gate.stride(), *valid_u8.stride(), *ape.stride(), *pk.stride(), *pool_valid.stride(),
        t_len, n_pools, d, POOL=pool, BLOCK_J=block_j, BLOCK_P=block_p, BLOCK_D=block_d, HAS_KEY_VALID=has_valid,
        num_warps=1,
    )
    return pk, pool_valid
