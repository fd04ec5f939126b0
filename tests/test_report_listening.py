"""The graph-break listener around each call of an optimize() result (kda_compile.report.enter_calls_of /
exit_calls_of): the graph-break logger is on inside a call and restored after, and no call sweeps the level cache
of every logger in the process (Logger.setLevel's cost, paid on every decode step)."""
import importlib
import logging

report = importlib.import_module("kda_compile.report")  # the module (kda_compile.report is also the function)


def test_a_call_enables_the_break_logger_and_restores_it_without_a_global_cache_sweep(monkeypatch):
    sweeps = []
    monkeypatch.setattr(logging.Logger.manager, "_clear_cache", lambda: sweeps.append(1))  # what setLevel calls
    child = logging.getLogger(report.BREAK_LOGGER + ".child_for_test")
    breaks = logging.getLogger(report.BREAK_LOGGER)
    before = (breaks.level, breaks.propagate, breaks.isEnabledFor(logging.DEBUG), child.isEnabledFor(logging.DEBUG))
    assert not before[2], "the test needs the break logger off, as it is by default"
    owner = object()
    report.enter_calls_of(owner)
    try:
        assert breaks.isEnabledFor(logging.DEBUG) and child.isEnabledFor(logging.DEBUG)
        assert breaks.propagate is False
    finally:
        report.exit_calls_of()
    assert (breaks.level, breaks.propagate, breaks.isEnabledFor(logging.DEBUG),
            child.isEnabledFor(logging.DEBUG)) == before
    assert sweeps == [], "enter_calls_of / exit_calls_of swept every logger's cache"
