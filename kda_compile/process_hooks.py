"""The process-wide hooks kda_compile installs when it is first used, not when it is imported.

They are the import hook on ``sys.meta_path`` and the Dynamo substitutes of FLA's / Hugging Face's KDA and GDN
entry points (``kda_compile.passes.kda_substitution.install``; ``KDA_COMPILE_SUBSTITUTION=0`` registers none).
``import kda_compile`` leaves the interpreter's import machinery and Dynamo's substitution table as they were;
:func:`install` puts the hooks in place the first time one of these runs:

- ``kda_compile.optimize()`` (when it is called, before it compiles anything);
- the ``kda_compile`` backend (``torch.compile(..., backend="kda_compile")`` or a ``KdaCompileBackend``): around
  each call of the compiled callable, through the backend's ``backend_ctx_ctor``, which Dynamo enters before it
  traces the frame, so the first graph already sees the substitutes; and again when the backend compiles a graph,
  for callers that do not enter that context.

Once installed they stay for the process, as the substitutes are process-wide in Dynamo. What ``import
kda_compile`` still does: it registers the ``torch.ops.kda_compile`` ops (with their fake, autograd and sharding
rules and the compile-cache tag of their source), the ``kda_compile`` backend name with Dynamo, and the forwarding
of a backend's context through ``torch.compile`` (``backend.forward_backend_contexts_through_torch_compile``),
which must be in place before ``torch.compile(..., backend="kda_compile")`` builds its wrapper.
"""
from __future__ import annotations

import logging
import threading

from kda_compile.passes.substitution import install as kda_substitution

logger = logging.getLogger("kda_compile.process_hooks")

_lock = threading.Lock()
_installed = False


def install() -> None:
    """Install the import hook and the Dynamo substitutes, once per process (idempotent, thread-safe; after the
    first call a flag check, since the backend calls it on every call of a compiled callable)."""
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        on = kda_substitution.install()
        logger.debug("process hooks installed (KDA substitution %s)", "on" if on else "off")
        _installed = True


def installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return _installed
