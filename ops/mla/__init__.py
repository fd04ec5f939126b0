"""Multi-head latent attention (MLA) as a torch.compile-native custom op (``torch.ops.kda_compile.mla_*``).

Public: ``mla_attention`` (from Hugging Face's latent cache to per-head outputs; absorbed or expanded
per call) and ``explain_mla_path`` (which form a call takes, and why). Layout of the folder:
``reference.py`` (both forms in torch), ``path_choice.py`` (the cost model choosing between them),
``triton_decode.py`` (the split-KV absorbed decode kernel, any GPU), ``wgmma_source.py`` /
``wgmma_decode.py`` (the Hopper warpgroup-MMA decode kernel, CUDA compiled at run time by NVRTC, and its
launcher), ``decode_kernels.py`` (which of the two runs a call), ``custom_ops.py`` (torch.library
registration), ``api.py`` (checks and public functions).
"""
from kda_compile.ops.mla.api import explain_mla_path, mla_attention

__all__ = ["mla_attention", "explain_mla_path"]
