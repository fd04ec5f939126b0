"""The pass manager: runs the graph rewrites a :class:`kda_compile.Config` enables on one Dynamo
graph, in the order of :data:`PIPELINE`, and collects what each did into a :class:`GraphReport`.

Each step of the pipeline has one boolean field of its name in the config that switches it on or off;
the manager looks the steps up instead of branching on each flag. A step is a rewrite class
(:class:`GraphRewrite`, registered by name in :data:`REWRITES`; every rewrite is idempotent: running it on
its own output changes nothing) or the report of trace-time substitution's sites (:class:`SiteReport`),
which reads the graph and changes nothing: substitution happened before the graph existed.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Union

import torch.fx

from kda_compile.config import NOT_REWRITES
from kda_compile.passes.attention.sdpa import SdpaAttentionRewrite
from kda_compile.passes.attention.softmax import SoftmaxAttentionRewrite
from kda_compile.passes.delta_rule.prologue import KDAPrologueRewrite
from kda_compile.passes.delta_rule.recurrence import KDARecurrenceRewrite
from kda_compile.passes.delta_rule.state_in_place import DecodeStateInPlaceRewrite
from kda_compile.passes.dsa.attention import DSAAttentionRewrite
from kda_compile.passes.dsa.compressed import CompressedAttentionRewrite
from kda_compile.passes.mla.absorb import MLAAbsorbRewrite
from kda_compile.passes.report import GraphReport
from kda_compile.passes.rewrite import REWRITES, GraphRewrite, RewriteLog, register_rewrite
from kda_compile.passes.substitution.sites import report_substitution_sites

if TYPE_CHECKING:
    from kda_compile.config import Config

logger = logging.getLogger("kda_compile.passes")


@dataclass(frozen=True)
class SiteReport:
    """A pipeline step that only reports: ``report(gm, log)`` logs sites another mechanism produced."""

    name: str  # the Config field that switches it
    report: Callable[[torch.fx.GraphModule, RewriteLog], None]
    options: tuple[str, ...] = ()


Step = Union[type[GraphRewrite], SiteReport]

# The steps, in the order they run on every graph.
PIPELINE: tuple[Step, ...] = (
    KDARecurrenceRewrite,  # first: a loop it collapses is a KDA call the steps after it see
    KDAPrologueRewrite,  # after kda_recurrence: folds the prologue of every KDA call, collapsed ones too
    # after kda_prologue, so each KDA site is reported with its folded flags (Config.kda_substitution)
    SiteReport("kda_substitution", report_substitution_sites),
    DecodeStateInPlaceRewrite,  # after the site report, which reports each decode call as it was traced
    DSAAttentionRewrite,  # before the attention rewrites, which would take its attention as a dense one
    SoftmaxAttentionRewrite,
    SdpaAttentionRewrite,  # after softmax_attention
    CompressedAttentionRewrite,  # after the attention rewrites: DeepSeek-V4's attention they produced, with its mask
    MLAAbsorbRewrite,  # after the attention rewrites: it absorbs the attention they produced
)

for _step in PIPELINE:
    if not isinstance(_step, SiteReport):
        register_rewrite(_step)


def steps() -> list[Step]:
    """The pipeline, then the rewrites registered outside it (in registration order)."""
    return [*PIPELINE, *(cls for cls in REWRITES.values() if cls not in PIPELINE)]


def disabled_rewrites(config: "Config") -> tuple[str, ...]:
    """The rewrites ``config`` switches off, in field order: its rewrite fields (a registered rewrite's, or a
    rewrite option such as ``attention_mask_to_flags``) set to False."""
    return tuple(f.name for f in dataclasses.fields(config)
                 if f.name not in NOT_REWRITES and getattr(config, f.name) is False)


class PassManager:
    """Runs the enabled steps of :func:`steps`, in order, on a graph module."""

    def __init__(self, config: "Config") -> None:
        self.config = config
        self.steps = [step if isinstance(step, SiteReport) else step(config) for step in steps()
                      if config.rewrite_enabled(step.name)]
        self.disabled = disabled_rewrites(config)

    def run(self, gm: torch.fx.GraphModule, graph: str = "") -> GraphReport:
        log = RewriteLog()
        changed = 0
        for step in self.steps:
            if isinstance(step, SiteReport):
                step.report(gm, log)
            else:
                changed += step.apply(gm, log)
        if changed:
            gm.graph.lint()
            gm.recompile()
        report = log.report(graph, self.disabled)
        logger.debug("%s", report.format(verbose=True))
        return report
