"""Strict mode (kda_compile/strict.py): ``Config(strict=True)`` / ``KDA_COMPILE_STRICT=1`` turn a left-alone
candidate, an op fallback, an eager fallback and a graph break in kda_compile's code into a StrictModeError that
carries the report's reason and site; without it the same model runs and the report lists them."""
from __future__ import annotations

import os

import pytest
import torch

import kda_compile
from kda_compile import Config, StrictModeError, optimize, strict
from kda_compile.backend import KdaCompileBackend
from kda_compile.ops._common import record_fallback, strict_fallbacks

transformers = pytest.importorskip("transformers")

QUICK = dict(compiler="aot_eager")


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager").eval()


IDS = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))


def test_a_left_alone_site_raises_with_its_reason_and_site():
    """``output_attentions=True`` makes the softmax weights an output: softmax_attention leaves the site alone.
    Strict mode raises the StrictModeError itself (not Dynamo's wrapper), naming the rewrite, site and reason."""
    model = tiny_llama()
    fast = optimize(model, Config(strict=True, **QUICK))
    with pytest.raises(StrictModeError) as caught, torch.no_grad():
        fast(IDS, output_attentions=True)
    text = str(caught.value)
    assert "softmax_attention left layers.0.self_attn (modeling_llama.py" in text
    assert "the attention weights" in text and "kda_compile.attention does not return them" in text


def test_without_strict_the_same_site_runs_and_is_reported():
    model = tiny_llama()
    fast = optimize(model, Config(**QUICK))
    with torch.no_grad():
        got = fast(IDS, output_attentions=True).logits
        want = model(IDS, output_attentions=True).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert any(c.rewrite == "softmax_attention" for c in kda_compile.report(fast).left_alone)


def test_a_fully_rewritten_model_runs_in_strict_mode():
    model = tiny_llama()
    fast = optimize(model, Config(strict=True, **QUICK))
    with torch.no_grad():
        got = fast(IDS).logits
    assert torch.allclose(got, model(IDS).logits, atol=1e-5)
    assert kda_compile.report(fast).rewritten and not kda_compile.report(fast).left_alone


def test_the_backend_entry_point_raises_inside_dynamos_wrapper():
    model = tiny_llama()
    compiled = torch.compile(model, backend=KdaCompileBackend(Config(strict=True, **QUICK)))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as caught, torch.no_grad():
        compiled(IDS, output_attentions=True)
    assert isinstance(strict.unwrap(caught.value), StrictModeError)


@torch.compiler.disable
def _runs_a_slower_path(x: torch.Tensor) -> torch.Tensor:
    record_fallback("attention", "reference", "a test's stand-in for a call the fast kernel cannot take")
    return x * 2


class _FallsBack(torch.nn.Module):
    def forward(self, x):
        return _runs_a_slower_path(x + 1) - 1


def test_an_op_fallback_during_a_call_raises_in_strict_mode_and_is_counted_otherwise():
    x = torch.ones(3)
    with pytest.raises(StrictModeError, match="attention would run the reference implementation: a test's"):
        optimize(_FallsBack(), Config(strict=True, **QUICK))(x)
    assert torch.equal(optimize(_FallsBack(), Config(**QUICK))(x), torch.full((3,), 3.0))
    assert any(event.op == "attention" for event, _ in kda_compile.report().fallbacks)


def test_strict_fallbacks_scope_and_the_environment_switch(monkeypatch):
    with strict_fallbacks(), pytest.raises(StrictModeError):
        record_fallback("attention", "triton", "scoped")
    record_fallback("attention", "triton", "outside the scope")  # counted, not raised
    monkeypatch.setenv("KDA_COMPILE_STRICT", "1")
    assert Config().strict is True
    with pytest.raises(StrictModeError):
        record_fallback("attention", "triton", "process-wide")
    monkeypatch.setenv("KDA_COMPILE_STRICT", "0")
    assert Config().strict is False


def test_an_eager_fallback_raises_in_strict_mode(monkeypatch):
    """A compile error Dynamo suppresses (``suppress_errors``) runs the frame eagerly: strict mode still raises,
    from the eager fallback in the report."""
    monkeypatch.setattr(torch._dynamo.config, "suppress_errors", True)
    model = tiny_llama()
    fast = optimize(model, Config(strict=True, **QUICK))
    with pytest.raises(StrictModeError, match="did not run fully compiled:\n  eager fallback"), torch.no_grad():
        fast(IDS, output_attentions=True)


def test_only_graph_breaks_in_our_own_files_count(tmp_path):
    import importlib

    attention_api = importlib.import_module("kda_compile.ops.attention.api")  # ops.attention is also a function
    manager = importlib.import_module("kda_compile.passes.manager")
    assert strict.is_own_break(attention_api.__file__) and strict.is_own_break(manager.__file__)
    assert strict.is_own_break(os.path.join(os.path.dirname(kda_compile.__file__), "optimize.py"))
    # A model's file of the same base name as one of ours is the model's, and so is an unknown location.
    (tmp_path / "api.py").write_text("")
    assert not strict.is_own_break(str(tmp_path / "api.py")) and not strict.is_own_break("")
    assert not strict.is_own_break("/site-packages/transformers/models/llama/modeling_llama.py")


def test_a_parsed_graph_break_keeps_the_full_path_for_strict_mode():
    from kda_compile.report import parse_graph_break

    path = "/opt/models/modeling_kimi.py"
    event = parse_graph_break(f"Graph break in user code at {path}:42\nGraph Break Reason: data-dependent")
    assert event is not None and event.location == "modeling_kimi.py:42" and event.path == path
    assert not strict.is_own_break(event.path)


def test_a_graph_left_out_of_cuda_graphs_raises_but_a_prefill_does_not():
    from kda_compile.cuda_graphs import PREFILL_REASON
    from kda_compile.passes.report import GraphReport

    strict.check_graph(GraphReport("0/0", cuda_graphs=f"cuda graphs: not captured: {PREFILL_REASON}"))
    strict.check_graph(GraphReport("0/1", cuda_graphs="cuda graphs: captured"))
    with pytest.raises(StrictModeError, match="graph 0/2 is not fully rewritten:\n  cuda graphs: not captured: "
                                              "inputs with symbolic sizes"):
        strict.check_graph(GraphReport("0/2", cuda_graphs="cuda graphs: not captured: inputs with symbolic sizes"))


class _Routed(torch.nn.Module):
    def forward(self, x):
        n = int((x > 0).sum().item())  # a data-dependent scalar, as MoE routing reads its expert counts
        return x * n


def test_the_backend_entry_point_captures_data_dependent_ops_as_optimize_does():
    """torch.compile(backend="kda_compile") enters the backend's context around its calls (Dynamo's
    backend_ctx_ctor, forwarded through torch.compile's wrapper): the ``.item()`` is captured, one graph."""
    x = torch.randn(8)
    compiled = torch.compile(_Routed(), backend="kda_compile")
    assert torch.equal(compiled(x), _Routed()(x))
    assert len(kda_compile.report(compiled).graphs) == 1 and not kda_compile.report(compiled).notes
    assert torch._dynamo.config.capture_scalar_outputs is False  # switched on only for the call


def test_a_backend_that_does_not_capture_names_the_breaks_in_its_report():
    """With Config(capture_data_dependent_ops=False) the ``.item()`` breaks the graph; the report says so, with the
    two Dynamo options that capture it."""
    compiled = torch.compile(_Routed(), backend=KdaCompileBackend(Config(capture_data_dependent_ops=False, **QUICK)))
    compiled(torch.randn(8))
    notes = kda_compile.report(compiled).notes
    assert any("capture_scalar_outputs = True" in note and "data-dependent ops" in note for note in notes), notes
