"""The graph-break listener of the calls of an optimize() result (kda_compile.report): Dynamo logs graph breaks
only while it traces, so the graph-break logger is switched on while a call's frames compile (a
kda_compile.compile_scope hook) and restored after, a call that compiles nothing leaves it alone, and no switch
sweeps the level cache of every logger in the process (Logger.setLevel's cost)."""
import importlib
import logging

import torch

from kda_compile import Config, optimize

report = importlib.import_module("kda_compile.report")  # the module (kda_compile.report is also the function)


def test_the_break_logger_is_on_while_a_call_compiles_and_untouched_by_a_call_that_does_not(monkeypatch):
    sweeps, switches, during_compile = [], [], []
    monkeypatch.setattr(logging.Logger.manager, "_clear_cache", lambda: sweeps.append(1))  # what setLevel calls
    set_level = report._set_break_level
    monkeypatch.setattr(report, "_set_break_level", lambda level: (switches.append(level), set_level(level)))
    child = logging.getLogger(report.BREAK_LOGGER + ".child_for_test")
    breaks = logging.getLogger(report.BREAK_LOGGER)
    before = (breaks.level, breaks.propagate, breaks.isEnabledFor(logging.DEBUG), child.isEnabledFor(logging.DEBUG))
    assert not before[2], "the test needs the break logger off, as it is by default"

    def compile_eager(gm, example_inputs, compiler, patches):
        during_compile.append((breaks.isEnabledFor(logging.DEBUG), child.isEnabledFor(logging.DEBUG),
                               breaks.propagate))
        return gm.forward

    monkeypatch.setattr("kda_compile.backend._compile_rewritten", compile_eager)
    torch._dynamo.reset()
    compiled = optimize(lambda x: torch.sin(x) + 1, Config(compiler="eager"))
    x = torch.randn(4)
    compiled(x)
    assert during_compile == [(True, True, False)]
    assert len(switches) == 2, switches  # on for the compile, back after it
    assert (breaks.level, breaks.propagate, breaks.isEnabledFor(logging.DEBUG),
            child.isEnabledFor(logging.DEBUG)) == before
    compiled(x)  # Dynamo's cache: nothing traced, nothing switched
    assert len(during_compile) == 1 and len(switches) == 2
    assert sweeps == [], "switching the break logger swept every logger's cache"
    torch._dynamo.reset()
