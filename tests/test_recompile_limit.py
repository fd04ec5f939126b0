"""Several ``optimize()`` results in one process stay compiled, and what Dynamo runs eagerly anyway
is in the report.

Every instance of a model class runs the same ``forward`` code object, whose Dynamo cache holds
the entries of every ``optimize()`` result (each has its own backend); with Dynamo's default
``recompile_limit`` (8) the ninth result used to run eagerly while ``report()`` said nothing was
compiled. The cheap tests use a tiny attention module (a Dynamo trace of a fraction of a second);
one runs a tiny Hugging Face Llama through ``generate``.
"""
from __future__ import annotations

import importlib
import logging

import pytest
import torch
import transformers

from kda_compile import Config, optimize, report
from kda_compile.backend import KdaCompileBackend
from kda_compile.report import EagerFallback, clear_reports

QUICK = Config(compiler="eager")
optimize_module = importlib.import_module("kda_compile.optimize")  # the package attribute is the function
LIMIT_WARNING = "torch._dynamo hit config"


class TinyAttention(torch.nn.Module):
    """One softmax attention over ``[B, T, 16]``: every instance shares this forward's code object."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1) @ v


def inputs(length: int) -> torch.Tensor:
    return torch.randn(2, length, 16, generator=torch.Generator().manual_seed(length))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    clear_reports()
    yield
    torch._dynamo.reset()


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def dynamo_warnings():
    """Dynamo's warnings (its logger does not propagate to pytest's caplog): those of a limit hit."""
    handler = _Collect()
    dynamo_logger = logging.getLogger("torch._dynamo.convert_frame")
    dynamo_logger.addHandler(handler)
    try:
        yield lambda: [m for m in handler.messages if m.startswith(LIMIT_WARNING)]
    finally:
        dynamo_logger.removeHandler(handler)


N_MODELS, LENGTHS = 10, (4, 7, 9)  # 10 instances need at least 11 entries on TinyAttention.forward


def test_plain_torch_compile_of_this_program_falls_back(caplog, dynamo_warnings):
    """The reproduction: one backend per model, as optimize() makes, without its budget: Dynamo's
    default recompile_limit (8) is exceeded and the last models run eagerly."""
    caplog.set_level(logging.WARNING)
    ran_eager = 0
    with torch.no_grad():
        for seed in range(N_MODELS):
            backend = KdaCompileBackend(QUICK)
            compiled = torch.compile(TinyAttention(seed), backend=backend)
            for length in LENGTHS:
                compiled(inputs(length))
            ran_eager += not backend.reports
    assert ran_eager >= 1 and dynamo_warnings()
    assert report().eager_fallbacks == ()  # not an optimize() result: not recorded


def test_many_optimized_instances_stay_compiled(caplog, dynamo_warnings):
    caplog.set_level(logging.WARNING)
    models = [TinyAttention(seed) for seed in range(N_MODELS)]
    compiled = [optimize(m, QUICK) for m in models]
    prior = torch._dynamo.config.recompile_limit
    with torch.no_grad():
        for model, fast in zip(models, compiled):
            for length in LENGTHS:
                torch.testing.assert_close(fast(inputs(length)), model(inputs(length)))
    for fast in compiled:
        got = report(fast)
        assert got.graphs, "an optimize() result ran eagerly"
        assert got.eager_fallbacks == ()
        assert "no graph compiled" not in str(got)
    assert dynamo_warnings() == []
    assert report().eager_fallbacks == ()
    # A compile per instance and at most one dynamic recompile each: later lengths reuse a graph.
    assert N_MODELS <= sum(len(report(f).graphs) for f in compiled) <= 2 * N_MODELS
    assert torch._dynamo.config.recompile_limit == prior  # raised only during the calls


def test_the_budget_is_scoped_to_the_calls(caplog):
    caplog.set_level(logging.DEBUG, logger="kda_compile.optimize")
    before = optimize_module._made[0]
    first, second = optimize(TinyAttention(0), QUICK), optimize(TinyAttention(1), QUICK)
    made = before + 2
    expected = max(torch._dynamo.config.recompile_limit, 8 * made)
    assert optimize_module.recompile_limit() == expected
    seen = []

    def spy(gm, example_inputs):
        seen.append(torch._dynamo.config.recompile_limit)
        return gm.forward

    with torch.no_grad():
        first(inputs(4))
        torch.compile(TinyAttention(2), backend=spy)(inputs(4))  # not ours: Dynamo's own limit
        with pytest.raises(RuntimeError):
            second(torch.randn(2, 4, 3))  # a failing call restores the limit too
    assert seen == [torch._dynamo.config.recompile_limit] and seen[0] != expected
    assert any(f"recompile_limit={expected}" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("limit_type", ["accumulated_recompile_limit", "recompile_limit"])
def test_a_forced_fallback_is_reported(limit_type, monkeypatch, caplog):
    """Two entries allowed on TinyAttention.forward: the second model's calls run eagerly, and its
    report (and report()) says so and why, with a WARNING once."""
    caplog.set_level(logging.WARNING)
    monkeypatch.setattr(optimize_module, "_made", [0])  # as if these were the process's first two
    if limit_type == "recompile_limit":  # a budget of 1 entry per optimize() result: 2 in all
        monkeypatch.setattr(optimize_module, "ENTRIES_PER_OPTIMIZE", 1)
        patch = torch._dynamo.config.patch(recompile_limit=1)
    else:
        patch = torch._dynamo.config.patch(accumulated_recompile_limit=2)
    first_model, second_model = TinyAttention(0), TinyAttention(1)
    with patch, torch.no_grad():
        first, second = optimize(first_model, QUICK), optimize(second_model, QUICK)
        first(inputs(4)), first(inputs(7))  # static, then dynamic: two entries
        for length in (4, 9, 4):
            torch.testing.assert_close(second(inputs(length)), second_model(inputs(length)))
    assert report(first).eager_fallbacks == () and len(report(first).graphs) == 2
    got = report(second)
    assert got.graphs == ()
    (fallback,) = got.eager_fallbacks
    assert isinstance(fallback, EagerFallback)
    assert fallback.kind == limit_type and fallback.limit == 2 and fallback.count >= 1
    assert "'forward'" in fallback.function and "test_recompile_limit.py" in fallback.function
    assert fallback.reason
    text = str(got)
    assert "no graph compiled by kda_compile yet" not in text
    assert "Dynamo ran the calls eagerly" in text and f"torch._dynamo.config.{limit_type} (2)" in text
    everything = report()  # the process-wide report has the first model's graphs and the fallback
    assert len(everything.graphs) == 2 and everything.eager_fallbacks == got.eager_fallbacks
    assert "no graph compiled" not in str(everything) and "eager fallback: 'forward'" in str(everything)
    ours = [r for r in caplog.records if r.name == "kda_compile.report" and r.levelno == logging.WARNING]
    assert len(ours) == 1 and "eager fallback: 'forward'" in ours[0].getMessage()


def test_an_unrelated_limit_hit_is_not_ours(caplog, dynamo_warnings):
    """A limit hit by code compiled outside optimize() results stays out of the report."""
    caplog.set_level(logging.WARNING)
    compiled = torch.compile(TinyAttention(0), backend=lambda gm, example_inputs: gm.forward, dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1), torch.no_grad():
        for length in (4, 5):
            compiled(inputs(length))
    assert dynamo_warnings()  # Dynamo did hit its limit
    assert report().eager_fallbacks == ()


def test_parse_a_suppressed_compile_error():
    record = logging.LogRecord("torch._dynamo.convert_frame", logging.WARNING, __file__, 1,
                               "WON'T CONVERT forward /m/model.py line 12 \ndue to: \nTraceback:\n  ...\n"
                               "RuntimeError: boom", None, None)
    from kda_compile.report import parse_dynamo_warning

    event = parse_dynamo_warning(record)
    assert event == EagerFallback("'forward' (/m/model.py:12)", "compile error", None, "RuntimeError: boom")
    assert "ran eagerly (compile error" in event.summary()


def test_optimized_llama_models_and_generate_stay_compiled(caplog, dynamo_warnings):
    """Tiny Hugging Face Llama: a model called at two lengths and a second one's generate() at two
    prompt lengths share the decorator code object of every HF forward. With the user's limit at 2
    (standing in for a process with more models), optimize()'s budget keeps all of it compiled."""
    caplog.set_level(logging.WARNING)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=128, pad_token_id=0, eos_token_id=2,
                                   bos_token_id=1)
    torch.manual_seed(0)
    called = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    generating = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    prompts = [torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 8)]
    expected = [generating.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=3, do_sample=False)
                for p in prompts]
    with torch._dynamo.config.patch(recompile_limit=2), torch.no_grad():
        fast = optimize(called, QUICK)
        for p in prompts:
            fast(p)
        generating.forward = optimize(generating.forward, QUICK)
        try:
            got = [generating.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=3, do_sample=False)
                   for p in prompts]
        finally:
            del generating.forward
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    assert dynamo_warnings() == []
    assert report(fast).graphs and len(report(generating).graphs) >= 2
    assert report().eager_fallbacks == ()
    assert len(report(fast).graphs) + len(report(generating).graphs) > 2  # more than the user's limit

