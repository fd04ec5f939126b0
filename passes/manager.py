"""The pass manager: runs the graph rewrites a :class:`kda_compile.Config` enables on one Dynamo
graph and collects what each rewrite did into a :class:`GraphReport`.

A rewrite is a class registered by name (``@register_rewrite``), with one boolean field of the
same name in the config that switches it on or off; the manager looks rewrites up in the registry
instead of branching on each flag. Every rewrite must be idempotent: running it on its own output
changes nothing.
"""
from __future__ import annotations

import abc
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

import torch.fx

if TYPE_CHECKING:
    from kda_compile.config import Config

logger = logging.getLogger("kda_compile.passes")

TOP_LEVEL = "<top level>"  # the site of code outside any module (graph_tools.module_path)


# ----------------------------------------------------------------------------------------------
# What a rewrite reports
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rewritten:
    """One site a rewrite replaced: ``site`` (module path), ``source`` (model file:line), the op it
    became, and the arguments that matter (flags, scale, GQA ratio, ...)."""

    rewrite: str
    site: str
    source: str
    op: str
    details: Mapping[str, Any] = field(default_factory=dict)

    def change(self) -> str:
        """``(source) -> op(details)``: what became of the site, without its module path."""
        info = ", ".join(f"{k}={v}" for k, v in self.details.items())
        where = f"({self.source}) " if self.source else ""
        return f"{where}-> {self.op}({info})"

    def __str__(self) -> str:
        return f"{self.site} {self.change()}"


@dataclass(frozen=True)
class LeftAlone:
    """A candidate a rewrite saw and did not replace, with the reason."""

    rewrite: str
    site: str
    source: str
    reason: str

    def __str__(self) -> str:
        where = f" ({self.source})" if self.source else ""
        return f"{self.site}{where}: {self.reason}"


@dataclass(frozen=True)
class GraphReport:
    """Everything the rewrites did to one compiled graph."""

    graph: str
    rewritten: tuple[Rewritten, ...] = ()
    left_alone: tuple[LeftAlone, ...] = ()
    # Set by the backend when CUDA graphs were asked for (mode="reduce-overhead"): whether this graph is
    # captured, or why not (kda_compile.cuda_graphs.CudaGraphPlan.summary()).
    cuda_graphs: str = ""

    def sites(self) -> dict[str, list[Rewritten]]:
        """The rewritten entries grouped by site, in order of first appearance: one site can take
        several rewrites (the KDA call substituted, then its prologue folded into it; HF's MLA
        attention rewritten, then absorbed). A site is a module path; code outside any module
        (``<top level>``: a compiled function) is told apart by its source line."""
        groups: dict[str, list[Rewritten]] = {}
        for entry in self.rewritten:
            key = f"{entry.site} ({entry.source})" if entry.site == TOP_LEVEL and entry.source else entry.site
            groups.setdefault(key, []).append(entry)
        return groups

    def summary(self) -> str:
        sites = self.sites()
        count = f"{len(sites)} site(s) rewritten"
        if len(sites) != len(self.rewritten):
            count += f" ({len(self.rewritten)} rewrites)"
        lines = [f"graph {self.graph}: {count}, {len(self.left_alone)} candidate(s) left alone"]
        for site, entries in sites.items():
            if len(entries) == 1:
                lines.append(f"  rewritten   {entries[0]}")
                continue
            lines.append(f"  rewritten   {site}, by {', '.join(e.rewrite for e in entries)}:")
            lines += [f"                {e.rewrite}: {e.change()}" for e in entries]
        lines += [f"  left alone  {c}" for c in self.left_alone]
        if self.cuda_graphs:
            lines.append(f"  {self.cuda_graphs}")
        return "\n".join(lines)


class RewriteLog:
    """Collects the entries of every rewrite run on one graph."""

    def __init__(self) -> None:
        self.rewritten: list[Rewritten] = []
        self.left_alone: list[LeftAlone] = []

    def report(self, graph: str) -> GraphReport:
        return GraphReport(graph, tuple(self.rewritten), tuple(self.left_alone))


# ----------------------------------------------------------------------------------------------
# Rewrites and their registry
# ----------------------------------------------------------------------------------------------
class GraphRewrite(abc.ABC):
    """A rewrite of the Dynamo FX graph. Subclasses set ``name`` and implement :meth:`apply`."""

    name: ClassVar[str]

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
    """Class decorator: make a rewrite available to the pass manager under ``cls.name``."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"rewrite name must be a Python identifier (it is a Config field), got {name!r}")
    if name in REWRITES and REWRITES[name] is not cls:
        raise ValueError(f"rewrite name must be unique, got {name!r} registered twice")
    REWRITES[name] = cls
    return cls


class PassManager:
    """Runs the enabled rewrites, in registration order, on a graph module."""

    def __init__(self, config: "Config") -> None:
        self.config = config
        self.rewrites = [cls(config) for name, cls in REWRITES.items() if config.rewrite_enabled(name)]

    def run(self, gm: torch.fx.GraphModule, graph: str = "") -> GraphReport:
        log = RewriteLog()
        changed = 0
        for rewrite in self.rewrites:
            changed += rewrite.apply(gm, log)
        if changed:
            gm.graph.lint()
            gm.recompile()
        report = log.report(graph)
        logger.debug("%s", report.summary())
        return report
