"""Which kernel runs an absorbed MLA call on CUDA: the Hopper wgmma kernel or the Triton split kernel.

- ``wgmma`` (``decode/wgmma_decode.py``, CUDA compiled by NVRTC): sm_90 GPUs, bfloat16 / float16, latent 512
  + rope 64, at least ``WGMMA_MIN_ROWS`` query rows (Sq x H); faster than the Triton kernel from 64 heads
  (docs/mla-decode-kernels.md section 5).
- ``triton`` (``decode/triton_decode.py``): every other call (any GPU, any width, float32, fewer rows: at 32
  heads and one query the Triton kernel's 32-row blocks are as fast as a half-empty 64-row wgmma block).

``KDA_COMPILE_MLA_DECODE_KERNEL`` = ``auto`` (default) | ``triton`` | ``wgmma`` overrides the choice
(``wgmma`` still runs Triton, logged, on calls the kernel cannot take). A call that an sm_90 GPU would
run with the wgmma kernel but cannot (misaligned rows, NVRTC missing or failing, a cache layout the
driver's TMA descriptors refuse) runs Triton and is recorded as a fallback (logged once, shown by the
rewrite report). The choice is a kernel menu (:data:`MENU`, ops/_kernel_choice.py; docs/kernel-choice.md).
"""
from __future__ import annotations

from kda_compile.ops import envs
from kda_compile.ops._kernel_choice import Choice, Kernel, KernelMenu
from kda_compile.ops._nvrtc import NvrtcUnavailable
from kda_compile.ops.mla.decode import wgmma_decode
from kda_compile.ops.mla.decode.triton_decode import mla_decode_attention

KERNEL_ENV = envs.MLA_DECODE_KERNEL
KERNELS = ("auto", "triton", "wgmma")
WGMMA_MIN_ROWS = 64  # one full wgmma M block (64 heads of one query, or 32 heads x 2 queries, ...)
_OP = "mla_attention"


def requested_kernel() -> str:
    return envs.mla_decode_kernel()


def _partial_block(q_lat, q_rope, kv_latent, k_rope) -> str | None:
    rows = q_lat.shape[1] * q_lat.shape[2]
    if rows < WGMMA_MIN_ROWS:
        return f"{rows} query rows (the wgmma kernel takes blocks of {WGMMA_MIN_ROWS})"
    return None


def _layout_sentence(q_lat, q_rope, kv_latent, k_rope) -> str | None:
    why = wgmma_decode.layout_problem(q_lat, q_rope, kv_latent, k_rope)
    return None if why is None else f"the wgmma decode kernel cannot run this call: {why}"


# Outside the wgmma kernel's design (not sm_90, another dtype or width) Triton is the call's kernel; a layout the
# kernel cannot take is a recorded fallback; fewer than a block of rows is a cost rule (Triton's blocks fit them).
MENU = KernelMenu(_OP, (
    Kernel("wgmma", "wgmma decode kernel", outside_design=lambda q_lat, q_rope, kv_latent, k_rope:
           wgmma_decode.outside_design(q_lat, q_rope, kv_latent), cannot_run=_layout_sentence,
           costlier=_partial_block),
    Kernel("triton", "Triton decode kernel"),
))


def _choice(q_lat, q_rope, kv_latent, k_rope) -> Choice:
    """:data:`MENU`'s choice for this call, ``KDA_COMPILE_MLA_DECODE_KERNEL`` its request (one that cannot run
    falls back to Triton, recorded)."""
    return MENU.choose(q_lat, q_rope, kv_latent, k_rope, requested=requested_kernel(), refused="fall back")


def choose_decode_kernel(q_lat, q_rope, kv_latent, k_rope) -> tuple[str, str]:
    """(kernel, why): "wgmma" or "triton" for this call (:func:`_choice`), and the reason in words."""
    choice = _choice(q_lat, q_rope, kv_latent, k_rope)
    if choice.name == "triton" and not choice.passed_over:
        return "triton", f"{KERNEL_ENV}=triton"
    if choice.name == "wgmma":
        return "wgmma", "sm_90, half precision, latent 512 + rope 64"
    return "triton", "; ".join(why for _, why in choice.passed_over)


def mla_decode(q_lat, q_rope, kv_latent, k_rope, attn_mask, scale: float, is_causal: bool):
    """(o_lat, lse) of the absorbed form on CUDA, with the chosen kernel (see the module docstring);
    the contract of ``triton_decode.mla_decode_attention``."""
    if _choice(q_lat, q_rope, kv_latent, k_rope).name == "wgmma":
        try:
            return wgmma_decode.mla_decode_attention_wgmma(q_lat, q_rope, kv_latent, k_rope, attn_mask, scale,
                                                           is_causal)
        except NvrtcUnavailable as exc:
            MENU.after_failure(Choice(MENU.named("wgmma")), exc)
    return mla_decode_attention(q_lat, q_rope, kv_latent, k_rope, attn_mask, scale, is_causal)
