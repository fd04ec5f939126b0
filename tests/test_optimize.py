"""``kda_compile.optimize``, ``Config`` and ``report``: the public API of the rewrite pipeline.

Cheap tests run the rewritten graph with ``Config(compiler="aot_eager")``; the slow one runs
Inductor (a training step on a tiny Llama).
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import transformers

import kda_compile
from kda_compile import Config, optimize, report
from kda_compile.ops._common import record_fallback
from kda_compile.passes import REWRITES, GraphReport, LeftAlone, Rewritten

QUICK = Config(compiler="aot_eager")


def tiny_llama(layers=1):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   pad_token_id=0, eos_token_id=2, bos_token_id=1)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def ids(length=8, seed=0):
    return torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield


def rel_err(a, b):
    assert torch.isfinite(a).all()
    return float((a.double() - b.double()).norm() / b.double().norm())


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
def test_config_is_frozen_and_validated():
    config = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.softmax_attention = False
    with pytest.raises(TypeError, match="Config.softmax_attention must be a bool, got 'yes'"):
        Config(softmax_attention="yes")
    with pytest.raises(ValueError, match="Config.compiler must be one of inductor, aot_eager, eager, got 'tvm'"):
        Config(compiler="tvm")


def test_every_registered_rewrite_has_a_config_switch():
    assert "softmax_attention" in REWRITES
    for name in REWRITES:
        assert isinstance(getattr(Config(), name), bool)
        assert Config(**{name: False}).rewrite_enabled(name) is False
    with pytest.raises(ValueError, match="rewrite name must be a rewrite's Config field"):
        Config().rewrite_enabled("compiler")
    with pytest.raises(ValueError, match="rewrite name must be a rewrite's Config field"):
        Config().rewrite_enabled("capture_data_dependent_ops")  # a boolean field, but no rewrite


# ---------------------------------------------------------------------------------------------
# optimize()
# ---------------------------------------------------------------------------------------------
def test_optimize_rewrites_and_reports_the_model(caplog):
    model = tiny_llama()
    with caplog.at_level(logging.INFO, logger="kda_compile.report"):
        compiled = optimize(model, QUICK)
        with torch.no_grad():
            out = compiled(ids()).logits
    assert rel_err(out, model(ids()).logits) < 1e-5
    for key in (compiled, model):  # the compiled model and the model it was made from
        (graph,) = report(key).graphs
        (site,) = graph.rewritten
        assert site.site == "model.layers.0.self_attn" and site.op == "kda_compile.attention"
        assert site.details["is_causal"] is True and site.details["heads"] == "4/2"
    assert report().graphs[-1] is report(compiled).graphs[-1]
    assert any("model.layers.0.self_attn" in r.getMessage() and "-> attention(" in r.getMessage()
               for r in caplog.records)  # logged in the default form, which names our ops without the package
    assert "1 site(s) rewritten" in str(report(compiled))


def test_optimize_forward_for_generate():
    model = tiny_llama()
    prompt = ids(5)
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False)
    model.forward = optimize(model.forward, QUICK, dynamic=True)
    try:
        got = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False)
        graphs = report(model).graphs  # the module of a bound method answers too
    finally:
        del model.forward
    assert torch.equal(got, expected)
    assert len(graphs) >= 2 and all(len(g.rewritten) == 1 for g in graphs)


def test_config_can_switch_the_rewrite_off():
    model = tiny_llama()
    compiled = optimize(model, Config(softmax_attention=False, compiler="aot_eager"))
    with torch.no_grad():
        compiled(ids())
    (graph,) = report(compiled).graphs
    assert not graph.rewritten and not graph.left_alone


def test_left_alone_candidates_are_reported():
    model = tiny_llama()
    compiled = optimize(model, QUICK)
    with torch.no_grad():
        compiled(ids(), output_attentions=True)
    left = report(compiled).left_alone
    assert left and all("output_attentions" in c.reason for c in left)
    assert "left alone" in str(report(compiled))


@pytest.mark.parametrize("make, words", [
    (lambda m: torch.compile(m), "OptimizedModule"),
    (lambda m: torch.compile(m.forward), "result of torch.compile"),
    (lambda m: (m.compile(), m)[1], "model.compile()"),
    (lambda m: (setattr(m, "forward", torch.compile(m.forward)), m)[1], "forward was replaced"),
])
def test_optimize_refuses_a_compiled_model(make, words):
    with pytest.raises(TypeError, match=words):
        optimize(make(tiny_llama()))


def test_optimize_refuses_bad_arguments():
    model = tiny_llama()
    with pytest.raises(TypeError, match="optimize\\(\\) takes no backend"):
        optimize(model, backend="inductor")
    with pytest.raises(TypeError, match="config must be a kda_compile.Config or None, got dict"):
        optimize(model, {"softmax_attention": True})
    with pytest.raises(TypeError, match="model must be an nn.Module or a callable, got int"):
        optimize(3)


def test_report_of_an_unknown_model_explains_itself():
    with pytest.raises(ValueError, match="model must be a model returned by kda_compile.optimize"):
        report(torch.nn.Linear(2, 2))


def test_report_lists_fallback_events():
    record_fallback("attention_report_test", "reference", "unit test of the report")
    text = str(report())
    events = {event.op: count for event, count in report().fallbacks}
    assert events["attention_report_test"] >= 1
    assert "fallback: attention_report_test ran reference" in text


def test_report_summary_lists_each_site_once():
    """Two rewrites of one site (a KDA call substituted, then its prologue folded) are one site."""
    graph = GraphReport("0/0", rewritten=(
        Rewritten("kda_prologue", "layers.0.attn", "model.py:7", "kda_compile.ops.chunk_kda", {"beta": "sigmoid"}),
        Rewritten("kda_substitution", "layers.0.attn", "model.py:7", "kda_compile.ops.chunk_kda", {"kind": "chunk"}),
        Rewritten("softmax_attention", "layers.1.attn", "model.py:9", "kda_compile.attention", {"heads": "4/2"}),
    ), left_alone=(LeftAlone("softmax_attention", "layers.2.attn", "model.py:9", "output_attentions=True"),))
    assert list(graph.sites()) == ["layers.0.attn", "layers.1.attn"]
    # the default form: one line a site, the last rewrite's op and keywords first
    assert graph.summary().splitlines() == [
        "graph 0/0: 2 site(s) rewritten (3 rewrites), 1 candidate(s) left alone",
        "  rewritten   layers.0.attn (model.py:7) -> chunk_kda(kind=chunk, beta=sigmoid)",
        "  rewritten   layers.1.attn (model.py:9) -> attention(heads=4/2)",
        "  left alone  layers.2.attn (model.py:9): output_attentions=True",
    ]
    # the verbose form: each rewrite of a site on its own line
    assert graph.format(verbose=True).splitlines() == [
        "graph 0/0: 2 site(s) rewritten (3 rewrites), 1 candidate(s) left alone",
        "  rewritten   layers.0.attn, by kda_prologue, kda_substitution:",
        "                kda_prologue: (model.py:7) -> kda_compile.ops.chunk_kda(beta=sigmoid)",
        "                kda_substitution: (model.py:7) -> kda_compile.ops.chunk_kda(kind=chunk)",
        "  rewritten   layers.1.attn (model.py:9) -> kda_compile.attention(heads=4/2)",
        "  left alone  layers.2.attn (model.py:9): output_attentions=True",
    ]
    # Outside any module (a compiled function), two calls on two lines are two sites.
    top = GraphReport("1/0", rewritten=tuple(
        Rewritten("softmax_attention", "<top level>", f"fn.py:{line}", "kda_compile.attention") for line in (3, 5)))
    assert len(top.sites()) == 2 and top.summary().startswith("graph 1/0: 2 site(s) rewritten, 0 candidate(s)")


def test_public_names():
    assert kda_compile.optimize is optimize and kda_compile.Config is Config and kda_compile.report is report
    assert {"optimize", "Config", "report"} <= set(kda_compile.__all__)


@pytest.mark.slow
def test_optimize_with_inductor_training_step():
    """Default config (Inductor): a training step's loss and gradients match eager."""
    model = tiny_llama(layers=2).train()
    batch = ids(10)
    loss = optimize(model)(batch, labels=batch).loss
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = model(batch, labels=batch).loss
    ref.backward()
    assert abs(float(loss) - float(ref)) < 1e-5
    for n, p in model.named_parameters():
        assert rel_err(got[n], p.grad) < 1e-4, n
    assert sum(len(g.rewritten) for g in report(model).graphs) == 2
