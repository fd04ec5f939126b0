"""What a graph rewrite is: :class:`GraphRewrite` (a class with a ``name``, which is also the
:class:`kda_compile.Config` field that switches it, and an idempotent :meth:`~GraphRewrite.apply`), the
:class:`RewriteLog` it writes its sites and candidates to, and the registry of rewrites by name
(:data:`REWRITES`, :func:`register_rewrite`). The order rewrites run in is manager.py's ``PIPELINE``.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Callable, ClassVar

import torch.fx

from kda_compile.passes.report import GraphReport, LeftAlone, Rewritten

if TYPE_CHECKING:
    from kda_compile.config import Config


class RewriteLog:
    """Collects the entries of every rewrite run on one graph."""

    def __init__(self) -> None:
        self.rewritten: list[Rewritten] = []
        self.left_alone: list[LeftAlone] = []

    def report(self, graph: str, disabled: tuple[str, ...] = ()) -> GraphReport:
        return GraphReport(graph, tuple(self.rewritten), tuple(self.left_alone), disabled=disabled)


class GraphRewrite(abc.ABC):
    """A rewrite of the Dynamo FX graph. Subclasses set ``name`` and implement :meth:`apply`."""

    name: ClassVar[str]
    # The other Config fields this rewrite reads (its options, e.g. ``attention_mask_to_flags``); its switch is
    # the field ``name``.
    options: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: "Config") -> None:
        self.config = config

    @abc.abstractmethod
    def apply(self, gm: torch.fx.GraphModule, log: RewriteLog) -> int:
        """Rewrite ``gm.graph`` in place, log every site and candidate; return the sites rewritten."""

    def replace_site(self, log: RewriteLog, where: tuple[str, str], op: str, replace: Callable[[], dict]) -> bool:
        """Run ``replace`` (it inserts ``op`` for the site at ``where`` = (module path, source line) and returns
        the report's details) and log the site as rewritten. The op's argument checks raise ``TypeError`` /
        ``ValueError`` before anything is inserted: then the site is logged as left alone with that reason."""
        try:
            details = replace()
        except (TypeError, ValueError) as exc:
            log.left_alone.append(LeftAlone(self.name, *where, f"{op} refuses the arguments: {exc}"))
            return False
        log.rewritten.append(Rewritten(self.name, *where, op, details))
        return True


REWRITES: dict[str, type[GraphRewrite]] = {}


def register_rewrite(cls: type[GraphRewrite]) -> type[GraphRewrite]:
    """Class decorator: make a rewrite available to the pass manager under ``cls.name``. manager.py registers
    the rewrites of its ``PIPELINE``, in order; a rewrite registered here and not in the pipeline runs after
    it, in registration order."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"rewrite name must be a Python identifier (it is a Config field), got {name!r}")
    if name in REWRITES and REWRITES[name] is not cls:
        raise ValueError(f"rewrite name must be unique, got {name!r} registered twice")
    REWRITES[name] = cls
    return cls
