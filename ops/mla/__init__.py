"""Multi-head latent attention (MLA) as a torch.compile-native custom op (``torch.ops.kda_compile.mla_*``).

Public: ``mla_attention`` (from Hugging Face's latent cache to per-head outputs; absorbed or expanded
per call) and ``explain_mla_path`` (which form a call takes, and why). Layout of the folder: ``api.py`` (checks and
public functions), ``custom_ops.py`` (torch.library registration), ``reference.py`` (both forms in torch),
``path_choice.py`` (the cost model choosing between them), ``sharding.py`` (DTensor rules) and ``decode/``: the
absorbed decode kernels (``triton_decode.py``: split-KV, any GPU; ``wgmma_decode.py`` + ``wgmma_decode_source.py`` +
``wgmma_decode.cu``: the sm_90a warpgroup-MMA kernel compiled at run time by NVRTC) and ``kernels.py``, which of
the two runs a call.
"""
from kda_compile.ops.mla.api import explain_mla_path, mla_attention

__all__ = ["mla_attention", "explain_mla_path"]
