"""DTensor sharding rules of the ``torch.ops.kda_compile`` ops: the part every operator folder shares.

Each operator folder declares its rules in ``sharding.py`` as ``RULES = {op name: rule}``. A rule takes an
:class:`OpCall` (the op's arguments as DTensor sees them: a ``DTensorSpec`` for each tensor, the plain value
of everything else) and returns the placements it accepts, each a :class:`Strategy`: one placement per output,
and a placement per tensor argument by name (a tensor argument it does not name is replicated). DTensor then
picks the accepted strategy that needs the least communication for the inputs' current placements and runs
the op on the local shards (inside ``torch.compile`` too: the rule runs while AOTAutograd traces).

:func:`register_sharding_rules` registers every rule through the public
``torch.distributed.tensor.experimental.register_sharding`` when ``kda_compile.ops`` is imported. Without
torch.distributed, or without that API, it logs why and registers nothing: the ops run on plain tensors
exactly as before. docs/distributed.md has every op's placements.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

logger = logging.getLogger("kda_compile.ops.sharding")

RULE_FOLDERS = ("kda", "gdn", "attention", "mla", "dsa", "moe", "block_sparse", "conv1d")

_registered: dict[str, str] = {}  # op name -> operator folder whose rule serves it
_unavailable: list[str] = []  # why no rule was registered (empty once registered)


@dataclass(frozen=True)
class Strategy:
    """One accepted way to run an op on DTensors: ``outputs``, one placement per output of the op;
    ``inputs``, argument name -> placement (tensor arguments not named are replicated)."""

    outputs: tuple
    inputs: dict = field(default_factory=dict)


class OpCall:
    """The arguments of one op call as a sharding rule sees them, by the op schema's argument names."""

    def __init__(self, overload, args: tuple, kwargs: dict) -> None:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec

        self.overload = overload
        self.args, self.kwargs = args, kwargs
        names = [a.name for a in overload._schema.arguments]
        self.values = dict(zip(names, args))
        self.values.update(kwargs)
        self._order = names[:len(args)] + list(kwargs)  # the order DTensor lists the tensor inputs in
        self.spec_type = DTensorSpec  # what DTensor hands a rule for each tensor argument
        specs = [v for v in self.values.values() if isinstance(v, DTensorSpec)]
        self.mesh = specs[0].mesh if specs else None

    def __getitem__(self, name: str):
        return self.values.get(name)

    def spec(self, name: str):
        value = self.values.get(name)
        return value if isinstance(value, self.spec_type) else None

    def shape(self, name: str) -> tuple | None:
        """The global shape of tensor argument ``name``, or None when it is absent."""
        spec = self.spec(name)
        return None if spec is None else tuple(spec.tensor_meta.shape)

    def input_placements(self, chosen: dict) -> list:
        """One entry per argument in call order: the chosen placement of each tensor, None otherwise."""
        from torch.distributed.tensor import Replicate

        return [chosen.get(name, Replicate()) if self.spec(name) is not None else None for name in self._order]


def replicated(call: OpCall) -> Strategy:
    """Every input and output replicated: each rank runs the whole op (no communication)."""
    from torch.distributed.tensor import Replicate

    return Strategy(tuple(Replicate() for _ in call.overload._schema.returns))


def head_blocks(call: OpCall, head_dims: dict) -> int:
    """How many blocks the inputs' current placements cut the heads into: the product of the mesh sizes over
    the mesh dims on which any tensor of ``head_dims`` (argument name -> its head dim) is ``Shard(head dim)``.
    1 when no input is sharded on its heads (then replicated is the cheapest strategy anyway)."""
    from torch.distributed.tensor import Shard

    blocks = 1
    if call.mesh is None:
        return blocks
    for mesh_dim in range(call.mesh.ndim):
        if any(type(spec.placements[mesh_dim]) is Shard and spec.placements[mesh_dim].dim == dim
               for spec, dim in ((call.spec(n), d) for n, d in head_dims.items()) if spec is not None):
            blocks *= call.mesh.size(mesh_dim)
    return blocks


def heads_split_evenly(call: OpCall, head_dims: dict, head_counts) -> bool:
    """Whether the head-sharded strategy applies: some input is sharded on its heads, and every head count
    (query heads, key / value heads...) divides into that many blocks, so that each rank's block of query
    heads goes with exactly its block of key / value heads (grouped heads stay grouped)."""
    blocks = head_blocks(call, head_dims)
    return blocks > 1 and all(count % blocks == 0 for count in head_counts)


def placeholder(shape) -> bool:
    """An op's stand-in for an absent optional output or residual: a 1-D tensor of size 0."""
    return shape is not None and len(shape) == 1 and isinstance(shape[0], int) and shape[0] == 0


def shard_unless_placeholder(shape, dim: int):
    """``Shard(dim)`` for a real tensor, ``Replicate()`` for an absent-output placeholder."""
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if placeholder(shape) or len(shape) <= dim else Shard(dim)


def _dtensor_fake_builder():
    """DTensor's own builder of the fake inputs it runs an op's fake implementation on to get the outputs'
    global metadata, or None where torch has none under that name."""
    try:
        from torch.distributed.tensor._op_schema import _rebuild_tensor_from_dtensor_meta
    except ImportError:
        return None
    return _rebuild_tensor_from_dtensor_meta


def output_shapes(call: OpCall) -> list[tuple]:
    """The global shapes of the op's outputs: its fake implementation run on the inputs' global metadata,
    built exactly as DTensor builds them for the outputs' metadata, so that a rule places the outputs DTensor
    will describe. The device matters: which residuals a chunked delta-rule forward keeps depends on the
    backend chosen for it. torch 2.13 builds the fakes on the mesh's device type; torch 2.11 builds them on
    the CPU (so there, on a CUDA mesh, the global metadata of the residuals is the CPU backend's: placeholders,
    replicated, while each rank keeps its own residuals locally; the ops' backward reads only the local
    tensors)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    builder = _dtensor_fake_builder()

    def fake(value):
        if not isinstance(value, call.spec_type):
            return value
        if builder is not None:
            return builder(value)
        meta = value.tensor_meta
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=value.mesh.device_type)

    # Inside torch.compile the tracing fake mode (same symbolic sizes); outside, a fresh one. Not recorded
    # into a graph being traced: this runs only to read shapes.
    with detect_fake_mode() or FakeTensorMode(), disable_proxy_modes_tracing():
        out = call.overload(*(fake(a) for a in call.args), **{k: fake(v) for k, v in call.kwargs.items()})
    return [tuple(o.shape) for o in (out if isinstance(out, (tuple, list)) else (out,))]


def _adapt(overload, rule: Callable[[OpCall], list]) -> Callable:
    """A rule as ``register_sharding`` calls it: the op's arguments in, ``[(outputs, inputs), ...]`` out."""
    def sharding(*args, **kwargs):
        call = OpCall(overload, args, kwargs)
        return [(list(s.outputs), call.input_placements(s.inputs)) for s in rule(call)]

    sharding.__name__ = f"{overload._schema.name.split('::')[-1]}_sharding"
    return sharding


def _hash_every_flag(overload) -> None:
    """``register_sharding`` keys DTensor's cache of sharding decisions (and of output metadata) on the
    arguments from the first int onwards only; our ops' outputs also depend on earlier flags
    (``output_final_state``, ``dropout_p``, ``use_qk_l2norm_in_kernel``...). Key it on every non-tensor
    argument, so that a call with other flags never reuses another call's output shapes."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    arguments = overload._schema.arguments
    flags = [i for i, a in enumerate(arguments) if not _is_tensor_type(a.type)]
    first = flags[0] if flags else len(arguments)
    if any(_is_tensor_type(a.type) for a in arguments[first:]):
        raise RuntimeError(f"{overload}: a tensor argument follows the first flag; the cache key needs a new layout")
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.op_to_schema_info[overload] = RuntimeSchemaInfo(
        static_argnum=first, static_kwargkey=[arguments[i].name for i in flags], needs_pytree=True)


def _is_tensor_type(t) -> bool:
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)


def _why_unavailable() -> str | None:
    if not torch.distributed.is_available():
        return "this torch build has no torch.distributed"
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._op_schema import RuntimeSchemaInfo  # noqa: F401
        from torch.distributed.tensor.experimental import register_sharding  # noqa: F401
    except ImportError as exc:
        return f"torch {torch.__version__} lacks the DTensor custom-op API ({exc})"
    if not hasattr(getattr(DTensor._op_dispatcher, "sharding_propagator", None), "op_to_schema_info"):
        return f"torch {torch.__version__}'s DTensor keeps no per-op schema info (needed to cache by every flag)"
    return None


def register_sharding_rules() -> dict[str, str]:
    """Register the DTensor sharding rule of every ``torch.ops.kda_compile`` op (once per process).

    Returns op name -> the operator folder whose rule serves it; empty (and logged, with the reason) when
    this torch cannot take the rules. Never raises: the ops work on plain tensors whatever happens here."""
    if _registered or _unavailable:
        return dict(_registered)
    why = _why_unavailable()
    if why is None:
        try:
            from torch.distributed.tensor.experimental import register_sharding

            for folder in RULE_FOLDERS:
                for name, rule in importlib.import_module(f"kda_compile.ops.{folder}.sharding").RULES.items():
                    overload = getattr(torch.ops.kda_compile, name).default
                    register_sharding(overload)(_adapt(overload, rule))
                    _hash_every_flag(overload)  # after: register_sharding sets its own cache key
                    _registered[name] = folder
        except Exception as exc:  # a torch whose DTensor internals moved: log it, keep the ops usable
            why = f"registering failed ({type(exc).__name__}: {exc})"
    if why is not None:
        _unavailable.append(why)
        log = logger.info if not torch.distributed.is_available() else logger.warning
        log("DTensor sharding rules of the kda_compile ops not registered: %s; DTensor inputs to "
                       "these ops will be refused by DTensor (no sharding strategy)", why)
        return {}
    logger.debug("DTensor sharding rules registered for %s", ", ".join(sorted(_registered)))
    return dict(_registered)


def sharding_rules_status() -> tuple[dict[str, str], str | None]:
    """(op name -> operator folder of its registered rule, why none was registered or None)."""
    return dict(_registered), (_unavailable[0] if _unavailable else None)
