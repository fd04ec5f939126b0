"""CUDA fast path through torch's SDPA backend kernels: cuDNN, flash (FA2), memory-efficient (CUTLASS).

We call the aten backend ops directly (``_scaled_dot_product_cudnn_attention``,
``_flash_attention_forward``, ``_efficient_attention_forward`` and their backward ops) because they
return the log-sum-exp, take the causal alignment and window we need, and let our backward op run
the matching backward kernel. Which backend serves which case, and why:

| case                                   | backend      | why |
|----------------------------------------|--------------|-----|
| no mask, causal with Sq == Sk or none  | cuDNN        | fastest on sm90 (docs/attention.md section 1); takes d_qk 192 / d_v 128 |
| float/bool mask, forward               | cuDNN        | same; masks become an additive bias (bool -> -65504 like torch's own cuDNN path) |
| mask, backward pass                    | efficient    | cuDNN's backward returns NaN dQ with a bias tensor on sm90 (pytorch#196678) |
| causal with Sq != Sk, sliding window   | flash        | flash is bottom-right aligned and has a window; cuDNN's causal here is top-left |
| mask + causal with Sq != Sk            | efficient    | custom_mask_type 2 = causal from bottom-right, plus the bias |
| GQA (Hkv < H)                          | cuDNN/flash  | native GQA (never repeat K/V); memory-efficient needs equal heads |
| fp32                                   | efficient    | the only fp32 kernel |
The backend's own gates (``torch.backends.cuda.can_use_*``) are asked on every call, so a torch or
cuDNN release that narrows a backend just moves the case to the next one (or to Triton). Rows or
offsets not 16-byte aligned, softcap, dropout and everything the table does not cover run in our
Triton kernel. Forward and backward are chosen independently (they exchange only out and lse).

Sinks ride on any backend exactly: with ``a = sigmoid(lse - sink)``, ``out_sink = a * out``; in the
backward the kernel gets ``dO' = a * dO`` and ``out' = out_sink`` (its ``rowsum(dO' * out')`` is then
``a * rowsum(dO * out_sink)``, the exact softmax term), and ``dsink = -sum (1 - a) rowsum(dO * out_sink)``.

Rows with nothing to attend (all keys masked, or causal with Sq > Sk) get output 0 and lse -inf; the
backward hands the kernels lse = +inf for them so ``exp(s - lse) = 0``. With a bool mask on cuDNN a
row counts as empty when its lse is below -32768 (the -65504 fill dominates; scores are assumed
smaller than 32768 in magnitude).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

SDPA_BACKENDS = ("cudnn", "flash", "efficient")
_CUDNN_BOOL_FILL = -65504.0  # what torch's own cuDNN path uses for False (a -inf bias misbehaves there)
_CUDNN_EMPTY_ROW_LSE = -32768.0


# ----------------------------------------------------------------------------------------------
# Problem normalisation shared by forward and backward.
# ----------------------------------------------------------------------------------------------
def trim_keys_for_window(k, v, attn_mask, sq: int, is_causal: bool, sliding_window: int):
    """Drop the keys no query row can see under a sliding window, and flags that became vacuous.

    Returns (k, v, attn_mask, is_causal, sliding_window, kv_start). Keys before
    ``kv_start = max(0, Sk - Sq - W + 1)`` are outside every row's window; slicing them off keeps the
    bottom-right alignment. Afterwards the window is vacuous when ``Sk <= W`` and causality when
    ``Sq == 1`` (the last row sees every key), which lets decode steps use any backend.
    """
    sk = k.shape[2]
    kv_start = 0
    if is_causal and sliding_window > 0:
        kv_start = max(0, sk - sq - sliding_window + 1)
        if kv_start > 0:
            k, v = k[:, :, kv_start:], v[:, :, kv_start:]
            if attn_mask is not None and attn_mask.dim() >= 1 and attn_mask.shape[-1] != 1:
                attn_mask = attn_mask[..., kv_start:]
            sk -= kv_start
        if sk <= sliding_window:
            sliding_window = 0
    if is_causal and sliding_window == 0 and sq == 1:
        is_causal = False
    return k, v, attn_mask, is_causal, sliding_window, kv_start


def _mask4d(attn_mask):
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    return m


_BIAS_FLOOR = -1e30  # finite, and still finite after the kernels' scaling by log2(e)
#: A row whose best visible bias is at or below this attends uniformly (every score is absorbed).
FLOOR_ROW_BIAS = -1e29


def _finite_floor(bias):
    """Raise finite entries below -1e30 (Hugging Face pads with ``finfo.min``) to -1e30, keep -inf.

    The kernels scale the bias by log2(e) in float32: ``finfo.min`` of float32 / bfloat16 becomes -inf
    there, and a row padded with it would come back empty (output 0) instead of eager's uniform
    average. At -1e30 every score is still absorbed (ulp(1e30) ~ 1e23), so nothing else changes.
    float16's finfo.min (-65504) is safe already (and -1e30 does not exist in float16)."""
    if bias.dtype not in (torch.float32, torch.bfloat16):
        return bias
    return bias.masked_fill((bias < _BIAS_FLOOR) & (bias > float("-inf")), _BIAS_FLOOR)


def cudnn_bias(attn_mask, dtype):
    """The additive bias cuDNN gets: 4-D, in the query dtype, broadcast dims kept at size 1."""
    m = _mask4d(attn_mask)
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, _CUDNN_BOOL_FILL)
    return _finite_floor(m.to(dtype))


def efficient_bias(attn_mask, dtype, b: int, h: int, sq: int, sk: int):
    """The bias the memory-efficient kernel needs: [B, H, Sq, Sk] in the query dtype, last dim
    contiguous, other strides multiples of 16 (broadcast dims stay stride 0, so nothing is
    materialised beyond the mask's own shape)."""
    m = _mask4d(attn_mask)
    if m.dtype == torch.bool:
        m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
    else:
        m = _finite_floor(m.to(dtype))
    aligned = m.stride(-1) == 1 and m.shape[-1] % 16 == 0 and all(
        st % 16 == 0 for st, n in zip(m.stride()[:-1], m.shape[:-1]) if n > 1)
    if not aligned:
        padded = torch.zeros((*m.shape[:-1], sk + (-sk) % 16), dtype=dtype, device=m.device)
        padded[..., :sk].copy_(m.expand(*m.shape[:-1], sk))
        m = padded[..., :sk]
    return m.expand(b, h, sq, sk)


# ----------------------------------------------------------------------------------------------
# Eligibility: None when the backend can serve the case, else the reason it cannot.
# ----------------------------------------------------------------------------------------------
def _bias_stand_in(attn_mask, dtype, shape=None):
    """A tensor with the bias's shape and dtype for the backend gates, which read only shape, dtype
    and strides: every dim broadcast (stride 0) except the last (stride 1, as the real bias has; the
    gates refuse a last-dim stride of 0), so asking them costs Sk elements, not a mask-sized buffer."""
    if attn_mask is None:
        return None
    m = _mask4d(attn_mask)
    shape = tuple(shape or m.shape)
    return torch.empty(shape[-1], dtype=dtype, device=m.device).as_strided(shape, (0,) * (len(shape) - 1) + (1,))


def _params(q, k, v, mask, is_causal: bool, needs_grad: bool):
    def leaf(t):
        t = t.detach()
        return t.requires_grad_(True) if needs_grad else t

    return torch.backends.cuda.SDPAParams(leaf(q), leaf(k), leaf(v), mask, 0.0, is_causal, k.shape[1] != q.shape[1])


@functools.lru_cache(maxsize=None)
def _flash_has_window() -> bool:
    fwd = str(torch.ops.aten._flash_attention_forward.default._schema)
    bwd = str(torch.ops.aten._flash_attention_backward.default._schema)
    return "window_size_left" in fwd and "window_size_left" in bwd


def _aligned(t) -> bool:
    """16-byte aligned start and rows: what the backends' vectorised loads assume (torch's gates check
    only some of it). Broadcast/size-1 dims do not count."""
    step = max(1, 16 // t.element_size())
    return t.storage_offset() % step == 0 and all(
        st % step == 0 for st, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)


def why_not(backend: str, q, k, v, attn_mask, is_causal: bool, sliding_window: int, needs_grad: bool):
    """Why ``backend`` cannot serve this (already trimmed) problem, or None if it can."""
    h, hkv, sq, sk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    half = q.dtype in (torch.float16, torch.bfloat16)
    if not all(_aligned(t) for t in (q, k, v)):
        return "query/key/value rows or offsets are not 16-byte aligned"
    if backend == "cudnn":
        if not half:
            return "cuDNN attention takes float16/bfloat16 only"
        if sliding_window > 0:
            return "cuDNN (through torch) has no sliding window"
        if is_causal and sq != sk:
            return "cuDNN's causal mask is top-left aligned; the op's is bottom-right (Sq != Sk)"
        if attn_mask is not None and needs_grad:
            return "cuDNN's backward with a bias tensor returns NaN gradients on sm90 (pytorch#196678)"
        bias = _bias_stand_in(attn_mask, q.dtype)
        ok = torch.backends.cuda.can_use_cudnn_attention(_params(q, k, v, bias, is_causal, needs_grad))
        return None if ok else "torch.backends.cuda.can_use_cudnn_attention refused these inputs"
    if backend == "flash":
        if not half:
            return "flash attention takes float16/bfloat16 only"
        if attn_mask is not None:
            return "flash attention takes no mask"
        if q.shape[-1] != v.shape[-1]:
            return "flash attention needs d_qk == d_v"
        if q.shape[-1] % 8 != 0:
            return "flash attention needs a head dim that is a multiple of 8"
        if sliding_window > 0 and not _flash_has_window():
            return "this torch's flash attention op has no window arguments"
        ok = torch.backends.cuda.can_use_flash_attention(_params(q, k, v, None, False, needs_grad))
        return None if ok else "torch.backends.cuda.can_use_flash_attention refused these inputs"
    if backend == "efficient":
        if hkv != h:
            return "memory-efficient attention needs as many KV heads as query heads (it would repeat K/V)"
        if sliding_window > 0:
            return "memory-efficient attention (through torch) has no sliding window here"
        if is_causal and sq > sk:
            # its bottom-right causal mask gives wrong rows (not 0) for query rows that see no key at all
            # (docs/attention.md section 2)
            return "memory-efficient attention's bottom-right causal mask is wrong for Sq > Sk (rows with no key)"
        bias = _bias_stand_in(attn_mask, q.dtype, (q.shape[0], h, sq, sk))
        ok = torch.backends.cuda.can_use_efficient_attention(_params(q, k, v, bias, False, needs_grad))
        return None if ok else "torch.backends.cuda.can_use_efficient_attention refused these inputs"
    raise ValueError(f"backend must be one of {SDPA_BACKENDS}, got {backend!r}")


def choose(q, k, v, attn_mask, is_causal: bool, sliding_window: int, needs_grad: bool):
    """(backend, reasons): the first SDPA backend that serves the case, in speed order, and why the
    others were skipped (backend None when none can)."""
    reasons = {}
    for backend in SDPA_BACKENDS:
        reason = why_not(backend, q, k, v, attn_mask, is_causal, sliding_window, needs_grad)
        if reason is None:
            return backend, reasons
        reasons[backend] = reason
    return None, reasons


# ----------------------------------------------------------------------------------------------
# Placeholders for the RNG arguments (dropout always runs in Triton, so they are never read).
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _meta_outputs(backend: str):
    """Shapes/dtypes of the forward op's outputs in this torch (from its meta kernel)."""
    q = torch.empty((1, 1, 16, 8), dtype=torch.float16, device="meta")
    if backend == "cudnn":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, q, q, None, True, 0.0, False, False)
        return {"lse_dim": res[1].dim(), "seed": (res[6].shape, res[6].dtype), "offset": (res[7].shape, res[7].dtype)}
    qt = q.transpose(1, 2)
    if backend == "flash":
        res = torch.ops.aten._flash_attention_forward(qt, qt, qt, None, None, 16, 16, 0.0, False, False)
        return {"seed": (res[2].shape, res[2].dtype), "offset": (res[3].shape, res[3].dtype)}
    res = torch.ops.aten._efficient_attention_forward(qt, qt, qt, None, None, None, None, None, 0.0, 0, True)
    return {"seed": (res[2].shape, res[2].dtype), "offset": (res[3].shape, res[3].dtype)}


def _rng_placeholders(backend: str, device):
    meta = _meta_outputs(backend)
    # empty, not zeros: fill kernels for uint64 are missing on some CUDA builds, and the values are unread.
    return tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in (meta["seed"], meta["offset"]))


# ----------------------------------------------------------------------------------------------
# Forward / backward per backend. Inputs are trimmed [B, H, S, D] views (last stride 1).
# Outputs: out [B, H, Sq, Dv] and lse [B, H, Sq] float32 (raw: empty rows not fixed yet).
# ----------------------------------------------------------------------------------------------
def sdpa_forward(backend: str, q, k, v, attn_mask, scale: float, is_causal: bool, sliding_window: int):
    b, h, sq, _ = q.shape
    sk = k.shape[2]
    if backend == "cudnn":
        bias = None if attn_mask is None else cudnn_bias(attn_mask, q.dtype)
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, bias, True, 0.0, is_causal, False, scale=scale)
        return res[0], res[1].reshape(b, h, sq)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if backend == "flash":
        window = {}
        if sliding_window > 0:
            window = dict(window_size_left=sliding_window - 1, window_size_right=0)
        res = torch.ops.aten._flash_attention_forward(
            qt, kt, vt, None, None, sq, sk, 0.0, is_causal, False, scale=scale, **window)
        return res[0].transpose(1, 2), res[1]
    bias = None if attn_mask is None else efficient_bias(attn_mask, q.dtype, b, h, sq, sk)
    res = torch.ops.aten._efficient_attention_forward(
        qt, kt, vt, bias, None, None, None, None, 0.0, 2 if is_causal else 0, True, scale=scale)
    return res[0].transpose(1, 2), res[1][:, :, :sq]


def sdpa_backward(backend: str, grad_out, q, k, v, out, lse_k, attn_mask, scale: float, is_causal: bool,
                  sliding_window: int):
    """dq, dk, dv (any layout) from the kernel's backward; ``lse_k`` already has +inf for empty rows
    and ``out``/``grad_out`` already carry the sink factors."""
    b, h, sq, _ = q.shape
    sk = k.shape[2]
    if backend == "cudnn":
        seed, offset = _rng_placeholders("cudnn", q.device)
        lse = lse_k.unsqueeze(-1) if _meta_outputs("cudnn")["lse_dim"] == 4 else lse_k
        bias = None if attn_mask is None else cudnn_bias(attn_mask, q.dtype)
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse.contiguous(), seed, offset, bias, None, None, sq, sk, 0.0, is_causal,
            scale=scale)
        return grads[0], grads[1], grads[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    got, ot = grad_out.transpose(1, 2), out.transpose(1, 2)
    if backend == "flash":
        seed, offset = _rng_placeholders("flash", q.device)
        window = {}
        if sliding_window > 0:
            window = dict(window_size_left=sliding_window - 1, window_size_right=0)
        grads = torch.ops.aten._flash_attention_backward(
            got, qt, kt, vt, ot, lse_k.contiguous(), None, None, sq, sk, 0.0, is_causal, seed, offset,
            scale=scale, **window)
    else:
        seed, offset = _rng_placeholders("efficient", q.device)
        lse = F.pad(lse_k, (0, (-sq) % 32), value=float("inf")).contiguous()  # the forward's padded layout
        bias = None if attn_mask is None else efficient_bias(attn_mask, q.dtype, b, h, sq, sk)
        grads = torch.ops.aten._efficient_attention_backward(
            got, qt, kt, vt, bias, ot, None, None, sq, sk, lse, 0.0, seed, offset,
            2 if is_causal else 0, False, scale=scale)
    return grads[0].transpose(1, 2), grads[1].transpose(1, 2), grads[2].transpose(1, 2)


def empty_row_threshold(backend: str, attn_mask) -> float:
    """lse at or below which a row attended nothing (the cuDNN bool fill is finite)."""
    if backend == "cudnn" and attn_mask is not None and attn_mask.dtype == torch.bool:
        return _CUDNN_EMPTY_ROW_LSE
    return float("-inf")
