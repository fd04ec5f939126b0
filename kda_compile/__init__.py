"""kda_compile: fast, torch.compile-native KDA, MLA and softmax attention for Hugging Face models.

Public API:
- ``kda_compile.ops``: the custom ops (``chunk_kda``, ``fused_recurrent_kda``, ...), callable
  directly, inside or outside ``torch.compile``.
- ``kda_compile.testing``: hypothesis strategies and error helpers to fuzz your own shapes.
"""
import logging

__version__ = "0.1.0"

logging.getLogger("kda_compile").addHandler(logging.NullHandler())

from kda_compile import ops  # noqa: E402,F401  (registers torch.ops.kda_compile.*)

__all__ = ["ops", "__version__"]
