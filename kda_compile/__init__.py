"""kda_compile: fast, torch.compile-native KDA, MLA and softmax attention for Hugging Face models.

Public API:
- ``kda_compile.ops``: the custom ops (``chunk_kda``, ``fused_recurrent_kda``, ...), callable
  directly, inside or outside ``torch.compile``.
- ``kda_compile.optimize(model, config=None, **compile_kwargs)``: torch.compile with the
  kda_compile graph rewrites (Hugging Face eager attention -> fused attention op) and Inductor;
  also available as ``torch.compile(model, backend="kda_compile")``.
- ``kda_compile.Config``: which rewrites run; ``kda_compile.report(model=None)``: what they did;
  ``Config(strict=True)`` turns anything left slower into a ``kda_compile.StrictModeError``.
- ``kda_compile.testing``: hypothesis strategies and error helpers to fuzz your own shapes.
"""
import logging

__version__ = "0.1.0"

logging.getLogger("kda_compile").addHandler(logging.NullHandler())

from kda_compile import ops  # noqa: E402,F401  (registers torch.ops.kda_compile.*)
from kda_compile.config import Config  # noqa: E402
from kda_compile.optimize import optimize  # noqa: E402
from kda_compile.report import report  # noqa: E402
from kda_compile.ops._common import StrictModeError  # noqa: E402
from kda_compile.backend import register_if_unknown as _register_backend  # noqa: E402

_register_backend()

from kda_compile.passes.substitution.install import install as _install_kda_substitution  # noqa: E402

_install_kda_substitution()  # Dynamo traces kda_compile.ops for FLA's / HF's KDA functions

__all__ = ["ops", "__version__", "Config", "optimize", "report", "StrictModeError"]
