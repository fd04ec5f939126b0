"""The ``kda_compile`` torch.compile backend: our graph rewrites, then Inductor.

``torch.compile(model, backend="kda_compile")`` works in a fresh process without importing this
package (the ``torch_dynamo_backends`` entry point in pyproject.toml names
:func:`kda_compile_backend`). Each graph Dynamo captures goes through the pass manager (the
rewrites enabled by the :class:`~kda_compile.config.Config`), is recorded in the rewrite report,
and is handed to Inductor (``compile_fx``) with torch.compile's ``mode`` and ``options``. With CUDA
graphs requested (``mode="reduce-overhead"``) each graph first gets a CUDA-graph plan: decode graphs are
captured with their cache tensors as static addresses, prefill graphs and graphs with symbolic sizes run
without CUDA graphs (:mod:`kda_compile.cuda_graphs`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import threading
from typing import Any, Callable

import torch

from kda_compile import compile_scope, cuda_graphs, process_hooks, strict
from kda_compile.config import Config
from kda_compile.passes import GraphReport, PassManager
from kda_compile.report_frames import traced_frame
from kda_compile.report_history import record_graph

logger = logging.getLogger("kda_compile.backend")

BACKEND_NAME = "kda_compile"
# Dynamo config switched on while a callable compiled with our backend runs (Config.capture_data_dependent_ops)
CAPTURE_DATA_DEPENDENT = ("capture_scalar_outputs", "capture_dynamic_output_shape_ops")


CAPTURE_SCOPE = compile_scope.Scope(tuple((name, True) for name in CAPTURE_DATA_DEPENDENT))
_NO_SCOPE = contextlib.nullcontext()


def forward_backend_contexts_through_torch_compile() -> bool:
    """Make ``torch.compile`` honour a backend's ``backend_ctx_ctor``, as ``torch._dynamo.optimize`` does.

    Dynamo enters ``backend.backend_ctx_ctor()`` around every call of a callable compiled with ``backend``
    (frames traced inside it see the context's config). ``torch.compile`` wraps a backend in
    ``torch._TorchCompileWrapper``, whose instances do not carry the attribute, so the context is lost. This
    copies it onto the wrapper instance, for backends that define one (none of torch's own do, so nothing
    else changes). Returns whether the wrapper could be adapted (a torch without it is left alone)."""
    wrapper = getattr(torch, "_TorchCompileWrapper", None)
    if wrapper is None or getattr(wrapper.__init__, "_kda_compile_forwards_ctx", False):
        return wrapper is not None
    original = wrapper.__init__

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        ctor = getattr(getattr(self, "compiler_fn", None), "backend_ctx_ctor", None)
        if ctor is not None and "backend_ctx_ctor" not in vars(self):
            self.backend_ctx_ctor = ctor

    __init__._kda_compile_forwards_ctx = True
    wrapper.__init__ = __init__
    return True


def inductor_config_patches(mode: str | None, options: dict | None) -> dict[str, Any]:
    """The Inductor config torch.compile would use for ``mode`` and ``options`` (options win)."""
    import torch._inductor
    import torch._inductor.config as inductor_config

    patches: dict[str, Any] = {}
    if mode not in (None, "default"):
        try:
            patches.update(torch._inductor.list_mode_options(mode))
        except (RuntimeError, KeyError):
            modes = "default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs"
            raise ValueError(f"mode must be one of {modes}, got {mode!r}") from None
    if options:
        if not isinstance(options, dict):
            raise TypeError(f"options must be a dict of Inductor config values, got {type(options).__name__}")
        known = inductor_config.get_config_copy()
        for key in options:
            if key not in known:
                raise ValueError(f"options must name Inductor config entries (torch._inductor.config), got {key!r}")
        patches.update(options)
    return patches


def _compile_rewritten(gm: torch.fx.GraphModule, example_inputs, compiler: str,
                       patches: dict[str, Any]) -> Callable:
    if compiler == "eager":
        return gm.forward
    if compiler == "aot_eager":
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)
    from torch._inductor.compile_fx import compile_fx

    with cuda_graphs.listening_for_skips():
        return compile_fx(gm, example_inputs, config_patches=patches)


def cuda_graph_plan(gm: torch.fx.GraphModule, example_inputs, compiler: str,
                    patches: dict[str, Any]) -> cuda_graphs.CudaGraphPlan | None:
    """The CUDA-graph plan of a graph Inductor compiles with CUDA graphs requested (``patches`` then
    switch them off for a graph left out), None when they are not requested (kda_compile.cuda_graphs)."""
    if compiler != "inductor" or not cuda_graphs.cudagraphs_requested(patches):
        return None
    plan = cuda_graphs.plan(gm, example_inputs, cuda_graphs.current_phase())
    if not plan.capture:
        patches[cuda_graphs.CUDAGRAPHS_OPTION] = False
    return plan


def _compile_id() -> tuple[str, Any]:
    """Dynamo's id of the graph being compiled: a label ("frame/compile", "_attempt" when Dynamo
    restarted the analysis) and a key without the attempt. A restart (e.g. to specialise a float)
    calls the backend again for the same graph; its report replaces the abandoned attempt's."""
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
    except Exception:  # noqa: BLE001  (only a label for the report)
        cid = None
    if cid is None:
        return "", None
    return str(cid), (getattr(cid, "frame_id", None), getattr(cid, "frame_compile_id", None))


class KdaCompileBackend:
    """A torch.compile backend bound to one :class:`Config`; keeps the reports of its graphs.

    ``torch.compile(model, backend=KdaCompileBackend(Config(...)))`` is what
    :func:`kda_compile.optimize` does. ``mode`` and ``options`` arrive from torch.compile as
    keyword arguments (only when not default) and go to Inductor.
    """

    _ids = itertools.count()

    def __init__(self, config: Config | None = None) -> None:
        if config is None:
            config = Config()
        if not isinstance(config, Config):
            raise TypeError(f"config must be a kda_compile.Config, got {type(config).__name__}")
        self.config = config
        self.reports: list[GraphReport] = []
        self._last_key: Any = None
        self._lock = threading.Lock()

    def backend_ctx_ctor(self) -> contextlib.AbstractContextManager:
        """What Dynamo enters around each call of a callable compiled with this backend: with
        ``Config.capture_data_dependent_ops`` the data-dependent ops (MoE routing: ``nonzero``, ``.item()``,
        ``.tolist()``) are captured with unbacked sizes while the frames are traced, so
        ``torch.compile(model, backend="kda_compile")`` traces the graphs :func:`kda_compile.optimize` does
        (:func:`forward_backend_contexts_through_torch_compile`). A kda_compile.compile_scope scope, applied only
        when Dynamo compiles; inside an ``optimize()`` result's call, whose own scope says the same, nothing.
        Entered before Dynamo traces a frame, it is where the backend's first use installs the process hooks
        (kda_compile.process_hooks)."""
        process_hooks.install()
        if self.config.skip_decode_guards and compile_scope.current() is None:
            raise ValueError("Config.skip_decode_guards=True is honoured by kda_compile.optimize() results only "
                             "(their calls know the decode phase and the cache); with torch.compile(model, "
                             "backend=KdaCompileBackend(config)) leave it False")
        if not self.config.capture_data_dependent_ops or compile_scope.current() is not None:
            return _NO_SCOPE
        return compile_scope.entered(CAPTURE_SCOPE)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, *, mode: str | None = None,
                 options: dict | None = None) -> Callable:
        process_hooks.install()  # for a caller that did not enter backend_ctx_ctor
        label, key = _compile_id()
        report = PassManager(self.config).run(gm, graph=label or f"#{next(self._ids)}")
        report = dataclasses.replace(report, frame=traced_frame())
        patches = inductor_config_patches(mode, options) if self.config.compiler == "inductor" else {}
        plan = cuda_graph_plan(gm, example_inputs, self.config.compiler, patches)
        if plan is not None:
            cuda_graphs.log_plan(report.graph, plan)
            report = dataclasses.replace(report, cuda_graphs=plan.summary())
        with self._lock:
            if key is not None and self._last_key == key:
                self.reports[-1] = report
            else:
                self.reports.append(report)
            self._last_key = key
        record_graph(report, key)
        if self.config.strict:
            strict.check_graph(report)
        return _compile_rewritten(gm, example_inputs, self.config.compiler, patches)


_default_backend = KdaCompileBackend()


def kda_compile_backend(gm: torch.fx.GraphModule, example_inputs, *, mode: str | None = None,
                        options: dict | None = None) -> Callable:
    """The ``kda_compile`` backend with the default :class:`Config` (what ``backend="kda_compile"`` runs)."""
    return _default_backend(gm, example_inputs, mode=mode, options=options)


kda_compile_backend.backend_ctx_ctor = _default_backend.backend_ctx_ctor  # Dynamo reads it off the function
forward_backend_contexts_through_torch_compile()


def register_if_unknown() -> None:
    """Register ``"kda_compile"`` with Dynamo unless the entry point (or an earlier import) already did.

    The entry-point loader registers the name itself when torch.compile first looks it up; also
    registering it here unconditionally would make torch assert ``duplicate name``.
    """
    from torch._dynamo.backends import registry

    if BACKEND_NAME in registry.list_backends(exclude_tags=()):
        return
    registry.register_backend(kda_compile_backend, name=BACKEND_NAME)
