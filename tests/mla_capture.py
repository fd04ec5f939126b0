"""A test backend for the MLA rewrite: runs the pass manager on each Dynamo graph, keeps the graph,
its report and how many ``kv_b_proj`` linears it held before the rewrite, then runs it with
aot_eager. Shared by tests/passes/test_mla_absorb.py and tests/models/test_mla_models.py
(imported as the top-level module ``mla_capture``: pytest puts ``tests/`` on ``sys.path``)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch._dynamo.backends.registry import lookup_backend

from kda_compile.config import Config
from kda_compile.passes import GraphReport, PassManager


def kv_b_linears(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Linear calls whose weight is a kv_b_proj parameter."""
    return [n for n in gm.graph.nodes if n.target is F.linear and "kv_b_proj" in getattr(n.args[1], "name", "")]


@dataclass
class MLACapture:
    config: Config = field(default_factory=lambda: Config(compiler="aot_eager"))
    graphs: list = field(default_factory=list)
    reports: list[GraphReport] = field(default_factory=list)
    kv_b_linears_before: list[int] = field(default_factory=list)

    def __call__(self, gm, example_inputs, **kwargs):
        self.kv_b_linears_before.append(len(kv_b_linears(gm)))
        self.reports.append(PassManager(self.config).run(gm, graph=str(len(self.reports))))
        self.graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    def calls(self, target, graph: int = -1) -> list[torch.fx.Node]:
        return [n for n in self.graphs[graph].graph.nodes if n.target is target or n.target == target]

    def entries(self, graph: int = -1, kind: str = "rewritten") -> list:
        """The MLA rewrite's report entries of one graph (``rewritten`` or ``left_alone``)."""
        return [e for e in getattr(self.reports[graph], kind) if e.rewrite == "mla_absorb"]
