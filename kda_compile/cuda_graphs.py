"""CUDA graphs for decode: which compiled graphs are captured, and the cache tensors they may write.

``mode="reduce-overhead"`` asks Inductor to replay each compiled graph from a CUDA graph (its cudagraph
trees). A decode step of a Hugging Face model is host-bound without it (Dynamo's guards, HF's cache code
and our ops' host code run at every token), so this is what makes ``generate()`` run at its kernels'
speed. Three things decide whether a graph can be captured, and the backend settles all three before
Inductor sees the graph (docs/cuda-graphs.md):

1. **Cache tensors are static addresses.** A decode graph writes the cache in place (HF's
   ``conv_state.copy_``, ``index_copy_`` into a ``StaticCache``, the recurrent state's ``copy_``) and reads
   all of it. Inductor's cudagraph trees accept a mutated input only when it is a static address, and copy
   every other input into the graph's own buffer at each replay (the whole KV cache, every step). HF marks
   its cache tensors static (``torch._dynamo.mark_static_address``) only when they are allocated outside
   a compiled region; when the prefill is compiled too (``model.forward = optimize(model.forward)``), the
   lazily allocated cache tensors are made inside the prefill graph and left unmarked: Inductor then logs
   "skipping cudagraphs due to mutated inputs" for the decode graph. So every graph input whose Dynamo
   source lies in a cache argument (:data:`CACHE_ARGUMENTS`) is marked static here, in the graph's
   placeholder metadata (what AOTAutograd reads to find the static inputs) and on the tensor itself.
   A cache passed later with other tensors (a new ``StaticCache``) makes cudagraph trees record the
   graph again for the new addresses; HF's ``generate`` reuses its static cache across calls, so that
   happens once per cache.
2. **Prefill is not captured.** A prompt's length changes from call to call: a CUDA graph per prompt
   length would be recorded and kept (its memory pool holding that prompt's activations). The graphs
   traced during a call whose tokens are more than one per sequence (:func:`phase_of_call`, set by
   :func:`kda_compile.optimize`'s wrapper) compile without CUDA graphs.
3. **Shapes are static.** A graph with symbolic input sizes (a ``DynamicCache`` whose attention keys
   grow every step, a prefill traced with dynamic shapes) would be recorded again for every new size;
   it compiles without CUDA graphs.

Every graph compiled with CUDA graphs asked for gets a line in its report (``cuda graphs: captured`` or
``cuda graphs: not captured: <reason>``), a graph left out is logged at INFO (prefill) or WARNING
(anything else), and Inductor's own skip messages ("skipping cudagraphs due to ...") seen while our
graphs compile or run are recorded for ``kda_compile.report()``.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from kda_compile import compile_scope

logger = logging.getLogger("kda_compile.cuda_graphs")

CUDAGRAPHS_OPTION = "triton.cudagraphs"  # the Inductor config entry mode="reduce-overhead" switches on
# The model arguments Hugging Face passes its caches in: a graph input reached through one of them is a
# cache tensor (its Dynamo source reads e.g. L['kwargs']['past_key_values'].layers[0].conv_states[0]).
CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "cache_params")
PREFILL, DECODE = "prefill", "decode"
PREFILL_REASON = ("a prefill graph (more than one token per sequence): prompt lengths vary, so it runs without CUDA "
                  "graphs and decode steps are captured")  # not captured by design: no fallback (report.py)


@dataclass(frozen=True)
class CudaGraphPlan:
    """What the backend does with one graph under ``mode="reduce-overhead"``.

    Attributes:
        capture: whether Inductor replays the graph from a CUDA graph.
        reason: why not (empty when captured).
        static_inputs: the cache inputs this plan marked as static addresses (their Dynamo sources).
    """

    capture: bool
    reason: str = ""
    static_inputs: tuple[str, ...] = ()

    def summary(self) -> str:
        if self.capture:
            marked = f"; {len(self.static_inputs)} cache tensor(s) marked static" if self.static_inputs else ""
            return f"cuda graphs: captured{marked}"
        return f"cuda graphs: not captured: {self.reason}"


def cudagraphs_requested(patches: dict[str, Any]) -> bool:
    """Whether the Inductor config ``patches`` (mode + options) turn CUDA graphs on, or leave them to
    Inductor's global config which does."""
    if CUDAGRAPHS_OPTION in patches:
        return bool(patches[CUDAGRAPHS_OPTION])
    import torch._inductor.config as inductor_config

    return bool(inductor_config.triton.cudagraphs)


# ----------------------------------------------------------------------------------------------
# The phase of the call being compiled (set by optimize()'s wrapper)
# ----------------------------------------------------------------------------------------------
def token_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tokens of a causal-LM call: ``input_ids`` (or ``inputs_embeds``), given by keyword or as the first
    positional argument, [batch, tokens, ...]; None when the call has neither."""
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), args[0] if args else None):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value
    return None


def tokens_per_sequence(args: tuple, kwargs: dict) -> int | None:
    """The query length of a causal-LM call: dim 1 of its :func:`token_input`; None when it has none."""
    tokens = token_input(args, kwargs)
    return None if tokens is None else int(tokens.shape[1])


def phase_of_call(args: tuple, kwargs: dict) -> str | None:
    """``"decode"`` for one token per sequence, ``"prefill"`` for more, None when the call carries no
    tokens we recognise."""
    tokens = tokens_per_sequence(args, kwargs)
    if tokens is None:
        return None
    return DECODE if tokens == 1 else PREFILL


def current_phase() -> str | None:
    """The phase of the call whose frame Dynamo is compiling: the :class:`kda_compile.compile_scope.Scope` an
    ``optimize()`` result's call entered; None outside such a call."""
    scope = compile_scope.current()
    return None if scope is None else scope.phase


# ----------------------------------------------------------------------------------------------
# Cache tensors as static addresses (outside any compiled region)
# ----------------------------------------------------------------------------------------------
def cache_of_call(kwargs: dict, result: Any) -> Any:
    """The cache a causal-LM call read or returned: ``past_key_values`` / ``cache_params`` given by keyword,
    else the result's ``past_key_values``; None when there is none."""
    for arg in CACHE_ARGUMENTS:
        cache = kwargs.get(arg)
        if cache is not None:
            return cache
    return getattr(result, "past_key_values", None)


# Per cache: (its number of layers, the answer) of the two predicates below, asked at every call of an optimize()
# result; a cache keeps its kind for its life (HF's layers are made with the cache), a new layer asks again
_compileable: "weakref.WeakKeyDictionary[Any, tuple[int, bool]]" = weakref.WeakKeyDictionary()
_static: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def _layer_count(cache: Any) -> int:
    layers = getattr(cache, "layers", None)
    return len(layers) if isinstance(layers, (list, tuple)) else -1


def _remembered(table: Any, cache: Any) -> Any:
    try:
        return table.get(cache)
    except TypeError:  # a cache that cannot be weakly referenced or hashed: asked again at every call
        return None


def _remember(table: Any, cache: Any, value: Any) -> None:
    try:
        table[cache] = value
    except TypeError:
        pass


def is_compileable_cache(cache: Any) -> bool:
    """HF's criterion for compiling decode: a compileable cache that is not a ``DynamicCache`` (whose
    attention layers grow each step)."""
    if cache is None:
        return False
    count = _layer_count(cache)
    known = _remembered(_compileable, cache)
    if known is not None and known[0] == count:
        return known[1]
    answer = bool(getattr(cache, "is_compileable", False))
    if answer:
        from transformers import DynamicCache

        answer = type(cache) is not DynamicCache
    _remember(_compileable, cache, (count, answer))
    return answer


def is_static_cache(cache: Any) -> bool:
    """Whether every layer of ``cache`` keeps fixed shapes in a compiled decode step."""
    if not is_compileable_cache(cache):
        return False
    count = _layer_count(cache)
    if _remembered(_static, cache) == count:
        return True
    # HF's sliding-window static layers keep their length as a Python int read in the graph: with static
    # shapes each value would be a new graph, so those caches keep automatic dynamic shapes (see plan()) unless
    # their layers were made capturable (kda_compile.sliding_window_cache); a capturable layer stays so
    static = not any(hasattr(layer, "cumulative_length_int") and not getattr(layer, "kda_compile_capturable", False)
                     for layer in getattr(cache, "layers", ()))
    if static:
        _remember(_static, cache, count)
    return static


def _tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, dict):
            yield from (v for v in value.values() if isinstance(v, torch.Tensor))
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def mark_cache_static(cache: Any) -> int:
    """Mark every tensor a Hugging Face cache holds (its layers' keys, values, lengths, conv and recurrent
    states, indexer keys) as a static address, as ``torch._dynamo.mark_static_address`` does (unguarded: a
    cache with other tensors reuses the compiled graph, and cudagraph trees record it again for the new
    addresses). Run outside any compiled region, after the prefill allocated the tensors: a decode graph
    traced later then takes them as static inputs. Returns how many tensors were newly marked."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, (list, tuple)):
        return 0
    marked = 0
    for layer in layers:
        if not hasattr(layer, "__dict__"):
            continue
        for tensor in _tensors_of(layer):
            if getattr(tensor, "_dynamo_static_input_type", None) is None:
                torch._dynamo.mark_static_address(tensor, guard=False)
                torch._dynamo.mark_static(tensor)  # its sizes too: another batch size is another graph
                marked += 1
    return marked


# ----------------------------------------------------------------------------------------------
# The plan for one graph
# ----------------------------------------------------------------------------------------------
def _source_name(node: torch.fx.Node) -> str:
    source = getattr(node, "_dynamo_source", None)
    if source is None:
        return ""
    try:
        return source.name
    except Exception:  # noqa: BLE001  (a source without a name is no cache argument)
        return ""


def is_cache_source(name: str) -> bool:
    """Whether a Dynamo source name reads a tensor out of a cache argument."""
    return any(f"['{arg}']" in name or f".{arg}" in name or name.startswith(arg) for arg in CACHE_ARGUMENTS)


def _is_symbolic(value: Any) -> bool:
    """Whether a placeholder's example value has a size, stride or value with free symbols (a SymInt that
    Dynamo specialised to a constant has none)."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    if isinstance(value, (torch.SymInt, torch.Tensor)):
        try:
            return bool(free_symbols(value))
        except Exception:  # noqa: BLE001  (a value the shape machinery cannot read: count it as symbolic)
            return True
    return False


def symbolic_inputs(gm: torch.fx.GraphModule, example_inputs) -> list[str]:
    """The placeholders whose sizes are symbolic (Dynamo traced them with dynamic shapes)."""
    found = []
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        if _is_symbolic(value):
            found.append(_source_name(node) or node.name)
    if not found and any(isinstance(value, torch.SymInt) and _is_symbolic(value) for value in example_inputs):
        found.append("a symbolic size")
    return found


def mark_cache_inputs_static(gm: torch.fx.GraphModule, example_inputs) -> tuple[str, ...]:
    """Mark the graph's cache tensors (inputs read from :data:`CACHE_ARGUMENTS`) as static addresses:
    in the placeholder's recorded tensor attributes, which AOTAutograd reads to list the static inputs
    for cudagraph trees, and on the example tensor, so later traces see it marked as HF's own static
    cache tensors are. Returns the sources newly marked."""
    marked = []
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
            continue
        name = _source_name(node)
        if not is_cache_source(name):
            continue
        tensor_dict = node.meta.setdefault("tensor_dict", {})
        if tensor_dict.get("_dynamo_static_input_type"):
            continue
        tensor_dict["_dynamo_static_input_type"] = "unguarded"
        if not getattr(value, "_dynamo_static_input_type", None) and not isinstance(value, torch._subclasses.FakeTensor):
            value._dynamo_static_input_type = "unguarded"  # what torch._dynamo.mark_static_address sets
        marked.append(name)
    return tuple(marked)


TOKEN_ARGUMENTS = ("input_ids", "inputs_embeds")


def phase_of_graph(gm: torch.fx.GraphModule) -> str | None:
    """The phase read from the graph itself, for graphs compiled outside an ``optimize()`` call
    (``torch.compile(model.forward, backend="kda_compile")``): the length of its ``input_ids`` /
    ``inputs_embeds`` input, where it has one."""
    for node in gm.graph.find_nodes(op="placeholder"):
        name = _source_name(node)
        if not any(f"['{arg}']" in name for arg in TOKEN_ARGUMENTS):
            continue
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            length = value.shape[1]
            return DECODE if not isinstance(length, torch.SymInt) and length == 1 else PREFILL
    return None


def plan(gm: torch.fx.GraphModule, example_inputs, phase: str | None) -> CudaGraphPlan:
    """Decide whether a graph compiled with CUDA graphs requested is captured (module docstring).
    ``phase`` is the call's (:func:`current_phase`); without one it is read from the graph."""
    if phase is None:
        phase = phase_of_graph(gm)
    if phase == PREFILL:
        return CudaGraphPlan(False, PREFILL_REASON)
    symbolic = symbolic_inputs(gm, example_inputs)
    sliding = [name for name in symbolic if name.endswith(".cumulative_length_int")]
    if sliding:
        return CudaGraphPlan(False, f"{sliding[0]}: Hugging Face's sliding-window static cache layers carry their "
                                    "length as a Python int that changes every step, which a CUDA graph would be "
                                    "recorded for at each value; kda_compile.optimize(..., mode='reduce-overhead') "
                                    "captures them when the step gets generate()'s precomputed attention masks "
                                    "(docs/cuda-graphs.md)")
    if symbolic:
        shown = ", ".join(symbolic[:3]) + (f" and {len(symbolic) - 3} more" if len(symbolic) > 3 else "")
        return CudaGraphPlan(False, f"inputs with symbolic sizes ({shown}) would record a CUDA graph per size; "
                                    "decode with a static cache (generate(..., cache_implementation='static') or "
                                    "transformers.StaticCache) keeps every size fixed")
    return CudaGraphPlan(True, static_inputs=mark_cache_inputs_static(gm, example_inputs))


def log_plan(graph: str, result: CudaGraphPlan) -> None:
    if result.capture:
        logger.debug("graph %s: %s", graph, result.summary())
    elif result.reason == PREFILL_REASON:
        logger.info("graph %s: %s", graph, result.summary())
    else:
        logger.warning("kda_compile: graph %s: %s; kda_compile.report() lists it", graph, result.summary())


# ----------------------------------------------------------------------------------------------
# Inductor's own skip messages
# ----------------------------------------------------------------------------------------------
INDUCTOR_CUDAGRAPHS_LOGGER = "torch._inductor.cudagraph_utils.__cudagraphs"  # its "skipping cudagraphs" warnings
SKIP_HISTORY = 64

_skips: dict[str, int] = {}
_skips_lock = threading.Lock()
_listening = threading.local()  # .depth > 0 while one of our graphs compiles or an optimize() call runs


class _SkipHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if not getattr(_listening, "depth", 0) and compile_scope.current() is None:
            return  # neither one of our compiles nor a call of ours
        try:
            text = record.getMessage().strip()
        except Exception:  # noqa: BLE001  (a malformed record is not ours to report)
            return
        if "skipping cudagraphs" not in text:
            return
        first = text.splitlines()[0][:300]
        with _skips_lock:
            if first in _skips or len(_skips) < SKIP_HISTORY:
                _skips[first] = _skips.get(first, 0) + 1


_handler = _SkipHandler(logging.DEBUG)


def attach_skip_handler() -> None:
    """Listen to Inductor's cudagraph skip logger (again, should something have removed the handler). Its
    records count while one of our graphs compiles (:func:`listening_for_skips`) or a call of an ``optimize()``
    result runs (a :mod:`kda_compile.compile_scope` scope is entered)."""
    skip_logger = logging.getLogger(INDUCTOR_CUDAGRAPHS_LOGGER)
    if _handler not in skip_logger.handlers:
        skip_logger.addHandler(_handler)


@contextlib.contextmanager
def listening_for_skips() -> Iterator[None]:
    """Record Inductor's "skipping cudagraphs" messages emitted inside this block (a compile of ours)."""
    attach_skip_handler()
    _listening.depth = getattr(_listening, "depth", 0) + 1
    try:
        yield
    finally:
        _listening.depth -= 1


def inductor_skips() -> tuple[tuple[str, int], ...]:
    """Inductor's "skipping cudagraphs" messages seen in our compiles and calls, with their counts."""
    with _skips_lock:
        return tuple(_skips.items())


def clear_inductor_skips() -> None:
    with _skips_lock:
        _skips.clear()
