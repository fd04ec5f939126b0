"""What the graph rewrites report: :class:`Rewritten` (a site replaced), :class:`LeftAlone` (a candidate not
replaced, with the reason) and :class:`GraphReport` (everything done to one compiled graph), with the two
forms a graph's report reads in: ``summary()`` / ``format()``, one line a site within :data:`WIDTH`
characters for a person to read, and ``format(verbose=True)``, every keyword of every rewrite
(``kda_compile.report`` describes both).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import sympy
import torch

TOP_LEVEL = "<top level>"  # the site of code outside any module (graph_tools.module_path)


# ----------------------------------------------------------------------------------------------
# What a rewrite reports, and how the report reads
# ----------------------------------------------------------------------------------------------
WIDTH = 160  # the longest line of the default report (one line a site); format(verbose=True) has no limit
DYNAMIC = "dynamic"  # what the report shows for a size known only when the graph runs
LONG_ITEM = 40  # a keyword longer than this (``entry=<the HF function a KDA call replaced>``) goes last on a short line

# Dynamo's symbols (sizes s0, unbacked sizes u0, floats zf0 / zuf0) as str() of a SymInt or of a sympy expression
# shows them; a sympy call or a parenthesised sum with no call inside (Min(6, s50), (s0 + 1)); what is left of an
# expression once its symbolic parts are "dynamic" (2*dynamic + 1).
_SYMBOL = re.compile(r"\b(?:s|u|zf|zuf)\d+\b")
_INNERMOST = re.compile(r"\b[A-Za-z_]\w*\([^()]*\)|\([\w\s+\-*/%.]*\)")
_ARITHMETIC = re.compile(rf"(?:{DYNAMIC}|\d+(?:\.\d+)?|[\s+\-*/%()])+")
_OP_PREFIXES = ("kda_compile.ops.", "kda_compile.")


def plain_value(value: Any) -> str:
    """``value`` as the report shows it. A size that depends on a symbolic size is ``dynamic`` and one Dynamo
    specialised is its number: never a sympy expression such as ``Min(6, s50)``, whose symbol names nothing
    outside the graph. The rewrites keep the value itself in ``details``; tuples and lists are shown element
    by element."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        value = value.node.expr
    if isinstance(value, sympy.Basic):
        return DYNAMIC if value.free_symbols else str(value)
    if isinstance(value, (tuple, list)):
        inner = ", ".join(plain_value(v) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    text = str(value)
    if not _SYMBOL.search(text):
        return text
    text = _SYMBOL.sub(DYNAMIC, text)
    while True:  # innermost first: Max(FloorDiv(s0, 2), 1) -> Max(dynamic, 1) -> dynamic
        collapsed = _INNERMOST.sub(lambda m: DYNAMIC if DYNAMIC in m.group() else m.group(), text)
        if collapsed == text:
            break
        text = collapsed
    return DYNAMIC if _ARITHMETIC.fullmatch(text) else text


def short_op(op: str) -> str:
    """``op`` without the package prefix: every op in the report is kda_compile's."""
    for prefix in _OP_PREFIXES:
        if op.startswith(prefix):
            return op[len(prefix):]
    return op


def clip(line: str, width: int) -> tuple[str, int]:
    """``line`` cut to ``width`` characters (ending in ``...`` where cut), and 1 if it was cut, else 0."""
    if len(line) <= width:
        return line, 0
    return line[:max(width - 3, 0)] + "...", 1


def fit_call(head: str, items: Sequence[str], width: int) -> tuple[str, int]:
    """``head(item, ..., +N more)`` with as many of ``items``, in order, as keep the line within ``width``
    characters, and N (how many were left out)."""
    if not items:
        return head, 0
    shown: list[str] = []
    for item in items:
        left = len(items) - len(shown) - 1
        tail = f", +{left} more)" if left else ")"
        if len(head) + 1 + len(", ".join([*shown, item])) + len(tail) > width:
            break
        shown.append(item)
    left = len(items) - len(shown)
    if not shown:
        return f"{head}(+{left} more)", left
    return f"{head}({', '.join(shown)}{f', +{left} more' if left else ''})", left


@dataclass(frozen=True)
class Rewritten:
    """One site a rewrite replaced: ``site`` (module path), ``source`` (model file:line), the op it
    became, and the arguments that matter (flags, scale, GQA ratio, ...)."""

    rewrite: str
    site: str
    source: str
    op: str
    details: Mapping[str, Any] = field(default_factory=dict)

    def keywords(self) -> str:
        """Every detail as ``key=value``, sizes shown by :func:`plain_value`."""
        return ", ".join(f"{k}={plain_value(v)}" for k, v in self.details.items())

    def change(self) -> str:
        """``(source) -> op(details)``: what became of the site, without its module path."""
        where = f"({self.source}) " if self.source else ""
        return f"{where}-> {self.op}({self.keywords()})"

    def __str__(self) -> str:
        return f"{self.site} {self.change()}"


def short_keywords(entries: Sequence[Rewritten]) -> list[str]:
    """The keywords of a site's one default line, from all the rewrites that took it: the last one's (the
    call of the op the site became) first, then what earlier ones add (a folded prologue's gate). What a
    reader scans for comes first: flags that are off and values that are None (an op's defaults) are left
    out, flags that are on are named after the values, and long values go last."""
    merged: dict[str, Any] = {}
    for entry in reversed(entries):
        for key, value in entry.details.items():
            merged.setdefault(key, value)
    values: list[str] = []
    flags: list[str] = []
    long: list[str] = []
    for key, value in merged.items():
        if value is None or value is False:
            continue
        if value is True:
            flags.append(key)
            continue
        item = f"{key}={plain_value(value)}"
        (long if len(item) > LONG_ITEM else values).append(item)
    return values + flags + long


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


@dataclass(frozen=True, eq=False)
class TracedFrame:
    """The Python frame Dynamo traced a graph from (built by ``kda_compile.report.traced_frame``). Its name
    heads the graph's report; weak references to the frame's ``self`` and code tell which model or function
    the graph was traced for, which ``report(torch.compile(model, backend="kda_compile"))`` needs: that one
    process-wide backend compiles the graphs of every model. Weak, so that a report keeps no model alive."""

    name: str  # "LlamaForCausalLM.forward", "step", "LlamaForCausalLM.forward, resumed at line 12"
    code_name: str  # the code's own name, a resume function's original ("wrapper" for HF's decorated forward)
    filename: str
    resumed: bool = False  # the code is Dynamo's continuation of code_name after a graph break
    owner: Callable[[], Any] | None = None  # weak reference to the frame's ``self``, if it has one
    code: Callable[[], Any] | None = None  # weak reference to the frame's code object


@dataclass(frozen=True)
class GraphReport:
    """Everything the rewrites did to one compiled graph.

    ``summary()`` / ``format()`` is the default form, one line a site within :data:`WIDTH` characters
    (sizes concrete or ``dynamic``, the op's off-flags left out, ``+N more`` where keywords did not fit);
    ``format(verbose=True)`` lists every rewrite of a site with all its keywords and every reason in full.
    """

    graph: str
    rewritten: tuple[Rewritten, ...] = ()
    left_alone: tuple[LeftAlone, ...] = ()
    # Set by the backend when CUDA graphs were asked for (mode="reduce-overhead"): whether this graph is
    # captured, or why not (kda_compile.cuda_graphs.CudaGraphPlan.summary()).
    cuda_graphs: str = ""
    # Set by the pass manager: the rewrites its Config switched off, which leave no other trace in the graph.
    disabled: tuple[str, ...] = ()
    # Set by the backend: the frame Dynamo traced the graph from (None for a graph compiled outside Dynamo).
    frame: TracedFrame | None = field(default=None, compare=False, repr=False)

    @property
    def function(self) -> str:
        """The callable the graph was traced from (``LlamaForCausalLM.forward``), or ``""`` if unknown."""
        return self.frame.name if self.frame is not None else ""

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

    def heading(self) -> str:
        """``graph 0/1 of LlamaForCausalLM.forward: 2 site(s) rewritten, 0 candidate(s) left alone``."""
        sites = self.sites()
        count = f"{len(sites)} site(s) rewritten"
        if len(sites) != len(self.rewritten):
            count += f" ({len(self.rewritten)} rewrites)"
        of = f" of {self.function}" if self.function else ""
        return f"graph {self.graph}{of}: {count}, {len(self.left_alone)} candidate(s) left alone"

    def render(self, verbose: bool = False, width: int = WIDTH) -> tuple[list[str], int]:
        """The graph's lines (heading, sites, candidates left alone, CUDA-graph plan; not the disabled
        rewrites, which a report of several graphs lists once) and how many keywords or reasons the
        default form shortened to fit ``width`` (0 under ``verbose``)."""
        if verbose:
            return self._verbose_lines(), 0
        rows = [clip(self.heading(), width)]
        rows += [self._site_line(site, entries, width) for site, entries in self.sites().items()]
        rows += [clip(f"  left alone  {c}", width) for c in self.left_alone]
        if self.cuda_graphs:
            rows.append(clip(f"  {self.cuda_graphs}", width))
        return [line for line, _ in rows], sum(cut for _, cut in rows)

    @staticmethod
    def _site_line(site: str, entries: list[Rewritten], width: int) -> tuple[str, int]:
        """One line for a site: the op it finally became (the last rewrite's: MLA absorption wraps the
        attention rewrite), that rewrite's source line, the keywords of all its rewrites."""
        last = entries[-1]
        where = f" ({last.source})" if last.source and site == last.site else ""
        return fit_call(f"  rewritten   {site}{where} -> {short_op(last.op)}", short_keywords(entries), width)

    def _verbose_lines(self) -> list[str]:
        lines = [self.heading()]
        for site, entries in self.sites().items():
            if len(entries) == 1:
                lines.append(f"  rewritten   {entries[0]}")
                continue
            lines.append(f"  rewritten   {site}, by {', '.join(e.rewrite for e in entries)}:")
            lines += [f"                {e.rewrite}: {e.change()}" for e in entries]
        lines += [f"  left alone  {c}" for c in self.left_alone]
        if self.cuda_graphs:
            lines.append(f"  {self.cuda_graphs}")
        return lines

    def format(self, verbose: bool = False, width: int = WIDTH) -> str:
        """This graph's report on its own, its disabled rewrites included (see the class docstring)."""
        lines, _ = self.render(verbose, width)
        if self.disabled:
            disabled = f"  disabled    {', '.join(self.disabled)}"
            lines.append(disabled if verbose else clip(disabled, width)[0])
        return "\n".join(lines)

    def summary(self) -> str:
        """The default form, what the backend logs at INFO for each graph: ``format()``."""
        return self.format()
