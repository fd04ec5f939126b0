"""GDN prefill inference on our own chunk kernels with the scalar gate (``prefill/run.py``): the ``chunk_kernels``
backend.

Registered ABOVE FLA (priority 20 > 10) for the calls it is designed for: CUDA, bf16 or fp16, K = V = 128, a
forward that keeps nothing for a backward (inference). bf16 runs the CUDA prepare kernel and, where the segment
cost model puts it ahead, the CUDA scan with its state in registers; fp16 runs the Triton kernels. With the
scalar gate the prepare forms ``A_qk`` / ``A_kk`` from plain products and a decay matrix of span sums, so its
cost does not depend on the data and every gate (``-inf`` included) is exact (docs/gdn.md section 4).

Left to the next backend (``in_design``; not recorded as fallbacks): training (FLA's GDN backward, or the KDA route
where fla-core refuses it, needs residuals in FLA's formats, which this forward does not write), other dtypes or
widths (the Triton kernels serve them under ``only_backends("chunk_kernels")``, which also lets tests run it on CPU
under the Triton interpreter), decode (``fused_recurrent_gdn``: FLA's fused step, or our decode kernel with the
scalar gate, ``decode/backend.py``).

A call variant whose kernels fail to compile is served by the next backend, recorded (``backends/own_kernels.py``).
"""
from __future__ import annotations


import torch
from kda_compile.ops.delta_rule.backends import own_kernel
from kda_compile.ops.gdn.backends.registry import GDNOptions, explicitly_requested, register_backend
from kda_compile.ops.gdn.backends.own_kernels import launch_or_fall_back

KERNEL_MODULE = "kda_compile.ops.gdn.prefill.run"
DESIGN_DTYPES = (torch.bfloat16, torch.float16)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DESIGN_HEAD_DIM = 128  # the CUDA prepare and scan kernels' K = V
MAX_HEAD_DIM = 256  # the Triton scan keeps a [next_pow2(K), BV] fp32 state tile on chip
_failed_variants: dict[tuple, str] = {}  # call variants whose Triton kernels did not compile -> the reason


_kernel_unusable, _launcher = own_kernel(KERNEL_MODULE, "chunk_gdn_prefill")


class ChunkKernelsBackend:
    name = "chunk_kernels"
    serves = frozenset({"chunk_gdn"})

    def in_design(self, device, dtype, K, V, opts: GDNOptions) -> bool:
        """Whether the call is one this backend is registered ahead of FLA for (or ``only_backends`` names it):
        the others go to FLA / the KDA route as before, and are not recorded as fallbacks."""
        return explicitly_requested(self.name) or (
            device.type == "cuda" and not opts.training and dtype in DESIGN_DTYPES
            and K == DESIGN_HEAD_DIM and V == DESIGN_HEAD_DIM)

    def unsupported_reason(self, device, dtype, K, V, opts: GDNOptions) -> str | None:
        asked = explicitly_requested(self.name)
        if device.type != "cuda" and not asked:
            return f"needs CUDA, got {device.type}"
        if opts.training:
            return ("inference only: a backward needs FLA's residual formats, which this forward does not write "
                    "(training runs FLA's GDN kernels or the KDA route)")
        if dtype not in KERNEL_DTYPES:
            return f"the chunk kernels take float16/bfloat16/float32, got {dtype}"
        if max(K, V) > MAX_HEAD_DIM:
            return f"the chunk kernels take K, V <= {MAX_HEAD_DIM}, got K={K}, V={V}"
        if not asked and (dtype not in DESIGN_DTYPES or K != DESIGN_HEAD_DIM or V != DESIGN_HEAD_DIM):
            return (f"designed for bfloat16/float16 with K = V = {DESIGN_HEAD_DIM} (got {dtype}, K={K}, V={V}); "
                    f"only_backends('{self.name}') runs other calls on its Triton kernels")
        return _kernel_unusable()

    def residual_meta(self, q, k, v, opts, save):
        return []

    def chunk_forward(self, q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, opts, output_final_state, save,
                      cu_seqlens_cpu=None):
        args = (q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens)

        def launch():
            o, final = _launcher()(
                *args, scale=opts.scale, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=opts.use_qk_l2norm_in_kernel, use_gate_in_kernel=opts.use_gate_in_kernel,
                use_beta_sigmoid_in_kernel=opts.use_beta_sigmoid_in_kernel, allow_neg_eigval=opts.allow_neg_eigval,
                cu_seqlens_cpu=cu_seqlens_cpu)
            return o, final, []

        return launch_or_fall_back(
            _failed_variants, "our Triton prefill kernels", "chunk_gdn", (*args, opts, output_final_state), launch,
            lambda fallback: fallback.chunk_forward(*args, opts, output_final_state, save,
                                                    cu_seqlens_cpu=cu_seqlens_cpu))

    def chunk_backward(self, *args):
        raise AssertionError("the chunk_kernels backend serves inference only (unsupported_reason)")  # unreachable


register_backend(ChunkKernelsBackend(), priority=20)
