"""A test backend that snapshots each Dynamo graph before and after the kda_compile passes and
runs the rewritten graph with ``aot_eager`` (AOTAutograd, no code generation: sub-second, so
rewrite tests stay cheap; Inductor runs only in the few end-to-end tests).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from torch._dynamo.backends.registry import lookup_backend

from kda_compile.config import Config
from kda_compile.ops.attention import attention
from kda_compile.passes import GraphReport, PassManager

SOFTMAXES = (torch.nn.functional.softmax, torch.softmax, "softmax")


def _snapshot(gm: torch.fx.GraphModule) -> "Snapshot":
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    kwargs = [{k: (v.name if isinstance(v, torch.fx.Node) else v) for k, v in n.kwargs.items()}
              for n in calls if n.target is attention]
    return Snapshot(gm.code, [n.target for n in calls], kwargs)


@dataclass
class Snapshot:
    """A graph as it was: its code, the targets of its calls, the kwargs of each attention call
    (graph nodes by name)."""

    code: str
    targets: list
    attention_kwargs: list[dict]

    def count(self, *targets) -> int:
        return sum(1 for t in self.targets if any(t is x or t == x for x in targets))


@dataclass
class GraphCapture:
    """``torch.compile(model, backend=GraphCapture())``; then inspect ``before`` / ``after`` /
    ``reports`` (one entry per compiled graph)."""

    config: Config = field(default_factory=lambda: Config(compiler="aot_eager"))
    before: list[Snapshot] = field(default_factory=list)
    after: list[Snapshot] = field(default_factory=list)
    reports: list[GraphReport] = field(default_factory=list)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, **kwargs):
        self.before.append(_snapshot(gm))
        self.reports.append(PassManager(self.config).run(gm, graph=str(len(self.reports))))
        self.after.append(_snapshot(gm))
        return lookup_backend("aot_eager")(gm, example_inputs)

    @property
    def graphs(self) -> int:
        return len(self.after)

    def attention_calls(self, graph: int = -1) -> int:
        return self.after[graph].count(attention)

    def softmaxes(self, graph: int = -1, which: str = "after") -> int:
        return getattr(self, which)[graph].count(*SOFTMAXES)

    def repeat_kv_expands(self, graph: int = -1) -> int:
        """repeat_kv's ``x[:, :, None]`` (before its expand) still in the graph."""
        return self.after[graph].code.count("[(slice(None, None, None), slice(None, None, None), None, ")
