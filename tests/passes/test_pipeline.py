"""The pass manager's pipeline (passes/manager.py): the order rewrites run in is the list a reader sees, every
Config rewrite field belongs to a step (its switch or one of its options), and the report of trace-time
substitution's sites is a step of the pipeline, not a registered rewrite."""
from __future__ import annotations

import dataclasses

from kda_compile import Config
from kda_compile.config import NOT_REWRITES
from kda_compile.passes import REWRITES, PassManager
from kda_compile.passes.manager import PIPELINE, SiteReport, steps


def test_registry_follows_the_pipeline():
    rewrites = [step.name for step in PIPELINE if not isinstance(step, SiteReport)]
    assert list(REWRITES)[:len(rewrites)] == rewrites
    assert "kda_substitution" not in REWRITES
    assert [step.name for step in steps()] == [step.name for step in PIPELINE] + list(REWRITES)[len(rewrites):]


def test_every_rewrite_field_belongs_to_a_step():
    names = [step.name for step in PIPELINE]
    options = {name for step in PIPELINE for name in step.options}
    fields = {f.name for f in dataclasses.fields(Config) if f.type in (bool, "bool") and f.name not in NOT_REWRITES}
    assert len(set(names)) == len(names) and not options & set(names)
    assert set(names) | options == fields


def test_a_switched_off_step_does_not_run():
    manager = PassManager(Config(kda_substitution=False, softmax_attention=False))
    names = [step.name for step in manager.steps]
    assert "kda_substitution" not in names and "softmax_attention" not in names and "mla_absorb" in names
