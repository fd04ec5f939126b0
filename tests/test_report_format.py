"""How ``kda_compile.report`` reads: one line a site within ``WIDTH`` characters by default and every keyword
under ``format(verbose=True)``, sizes as numbers or ``dynamic`` (never a sympy expression), each graph headed by
the callable it was traced from, the rewrites the Config switched off on one line, and an answer for
``report(torch.compile(model, backend="kda_compile"))`` that keeps apart the models that one process-wide
backend compiled.

Tiny random models on CPU: Kimi-Linear (three KDA layers, through HF's torch path, and an MLA layer) through
``optimize()`` with aot_eager, and Llamas through ``backend="kda_compile"`` whose default backend is switched to
aot_eager for the test.
"""
from __future__ import annotations

import re
import sys

import pytest
import sympy
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import kda_compile
from kda_compile import Config, backend, optimize
from kda_compile.bench import e2e_kimi
from kda_compile.passes.report import WIDTH, GraphReport, LeftAlone, Rewritten, plain_value
from kda_compile.report import Report, report
from kda_compile.report_frames import frame_of
from hf_kda_binding import torch_path

transformers = pytest.importorskip("transformers")

KIMI_CONFIG = Config(compiler="aot_eager", sdpa_attention=False, kda_recurrence=False)
HF_TORCH_FUNCTIONS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
                      "causal_conv1d_update")
SYMBOLIC = re.compile(r"\b(?:s|u|zf|zuf)\d+\b|\b(?:Min|Max|FloorDiv|CeilDiv|Mod|ToFloat|TruncToInt)\(")
SITE_LINE = "  rewritten   "


@pytest.fixture(scope="module")
def kimi_report() -> Report:
    """The report of a tiny Kimi-Linear model called at two prompt lengths (a static graph, then a dynamic one)."""
    torch._dynamo.reset()
    model = e2e_kimi.build_model(e2e_kimi.TINY, 4, "cpu", torch.float32).eval()
    modeling = sys.modules[type(model).__module__]
    fast = optimize(model, KIMI_CONFIG)
    with torch.no_grad(), torch_path(modeling, *(n for n in HF_TORCH_FUNCTIONS if hasattr(modeling, n))):
        for length in (9, 12):
            fast(torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(length)))
    got = report(fast)
    yield got
    torch._dynamo.reset()


def tiny_llama(layers: int = 1, heads: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def run(model, length: int = 6):
    with torch.no_grad():
        return model(torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(0)))


@pytest.fixture
def quick_default_backend(monkeypatch):
    """``backend="kda_compile"`` with aot_eager instead of Inductor (minutes of C++ builds on CPU)."""
    torch._dynamo.reset()
    monkeypatch.setattr(backend._default_backend, "config", Config(compiler="aot_eager"))
    yield
    torch._dynamo.reset()


def site_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(SITE_LINE)]


# ---------------------------------------------------------------------------------------------
# The default form and the verbose form, on a KDA model
# ---------------------------------------------------------------------------------------------
def test_default_lines_fit_the_width_and_verbose_has_every_keyword(kimi_report):
    text, full = str(kimi_report), kimi_report.format(verbose=True)
    assert kimi_report.format() == text
    too_long = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not too_long, too_long
    kda = [line for line in site_lines(text) if "-> chunk_kda(" in line]
    assert len(kda) == 3 * len(kimi_report.graphs), text
    assert all(re.search(r"kind=chunk, heads=2/2, K=16, V=16, .*\+\d+ more\)$", line) for line in kda), kda
    # the full form keeps what the default form leaves out: every keyword, the HF function replaced
    assert max(len(line) for line in full.splitlines()) > WIDTH
    for keyword in ("use_qk_l2norm_in_kernel=True", "initial_state=False", "lower_bound=None",
                    "entry=transformers chunk_kimi_delta_attention", "gate=softplus + dt_bias"):
        assert keyword in full and keyword not in text, keyword
    assert "by kda_prologue, kda_substitution:" in full
    assert "report.format(verbose=True)" in text.splitlines()[-1]


def test_one_line_a_site(kimi_report):
    lines = site_lines(str(kimi_report))
    expected = [f"  rewritten   {site} " for graph in kimi_report.graphs for site in graph.sites()]
    # 3 KDA layers and 1 MLA layer, and the experts of the 3 MoE layers
    assert len(lines) == len(expected) == 7 * len(kimi_report.graphs)
    assert all(line.startswith(prefix) for line, prefix in zip(lines, expected)), lines
    # MLA absorption wraps the attention rewrite: the line names the op the site became
    assert sum("model.layers.3.self_attn (modeling_kimi_linear.py:" in line and "-> mla_attention(" in line
               for line in lines) == len(kimi_report.graphs)


def test_graphs_are_named_by_the_callable_they_were_traced_from(kimi_report):
    assert len(kimi_report.graphs) == 2  # the second length recompiles with a dynamic length
    headings = [line for line in str(kimi_report).splitlines() if line.startswith("graph ")]
    assert headings == [f"graph {g.graph} of KimiLinearForCausalLM.forward: 7 site(s) rewritten (11 rewrites), "
                        f"0 candidate(s) left alone" for g in kimi_report.graphs]


def test_disabled_rewrites_are_one_line(kimi_report):
    lines = str(kimi_report).splitlines()
    assert lines.count("disabled: sdpa_attention, kda_recurrence") == 1, lines
    assert "disabled: sdpa_attention, kda_recurrence" in kimi_report.format(verbose=True).splitlines()
    assert kimi_report.graphs[0].summary().splitlines()[-1] == "  disabled    sdpa_attention, kda_recurrence"


def test_no_sympy_expression_in_the_report_of_a_dynamic_graph(kimi_report):
    for text in (str(kimi_report), kimi_report.format(verbose=True)):
        assert not SYMBOLIC.search(text), SYMBOLIC.search(text)


# ---------------------------------------------------------------------------------------------
# Values: concrete or "dynamic"
# ---------------------------------------------------------------------------------------------
def test_plain_value_shows_numbers_or_dynamic():
    s50, u0 = sympy.Symbol("s50", integer=True), sympy.Symbol("u0", integer=True)
    shape_env = ShapeEnv()
    unbacked = shape_env.create_unbacked_symint()
    assert plain_value(sympy.Min(6, s50)) == "dynamic"
    assert plain_value(2 * u0 + 1) == "dynamic"
    assert plain_value(sympy.Integer(6)) == "6"
    assert plain_value(unbacked) == "dynamic"
    assert plain_value(torch.sym_min(unbacked, 6)) == "dynamic"
    assert plain_value((2, unbacked, 16)) == "(2, dynamic, 16)"
    # text, as some rewrites record a size (str() of a SymInt)
    assert plain_value("Min(6, s50)") == "dynamic"
    assert plain_value("2*s0 + 1") == "dynamic"
    assert plain_value("key padding [B, s3]") == "key padding [B, dynamic]"
    assert plain_value("window Max(1, s7 - 4), causal") == "window dynamic, causal"
    assert plain_value("FloorDiv(Max(s0, 2) + (s1 - 1), 2)") == plain_value("floor(s0/2)") == "dynamic"
    for kept in ("2/2", "softplus + dt_bias", "torch.float32", "key padding [B, 1, 1, Sk]", 0.25, 16, True):
        assert plain_value(kept) == str(kept)


def test_a_symbolic_top_k_reads_dynamic_in_both_forms():
    graph = GraphReport("1/2", rewritten=(
        Rewritten("dsa_attention", "model.layers.0.self_attn.indexer", "modeling_deepseek_v32.py:120",
                  "kda_compile.dsa_indexer_topk", {"heads": 8, "head_dim": 16, "topk": "Min(6, s50)"}),))
    assert graph.rewritten[0].details["topk"] == "Min(6, s50)"  # the entry keeps what the rewrite recorded
    for text in (graph.summary(), graph.format(verbose=True)):
        assert "topk=dynamic" in text and "Min(" not in text and "s50" not in text, text


# ---------------------------------------------------------------------------------------------
# The default line's rules, on hand-made entries
# ---------------------------------------------------------------------------------------------
def test_default_line_leaves_out_off_flags_names_on_flags_and_counts_the_rest():
    details = {"kind": "chunk", "entry": "x" * 60, "use_gate_in_kernel": True, "initial_state": False,
               "lower_bound": None, "heads": "2/2"}
    graph = GraphReport("0/0", rewritten=(Rewritten("kda_substitution", "layers.0.attn", "m.py:1",
                                                    "kda_compile.ops.chunk_kda", details),))
    (line,) = site_lines(graph.summary())
    assert line == f"  rewritten   layers.0.attn (m.py:1) -> chunk_kda(kind=chunk, heads=2/2, use_gate_in_kernel, " \
                   f"entry={'x' * 60})"
    (narrow,) = site_lines(graph.format(width=81))
    assert narrow == "  rewritten   layers.0.attn (m.py:1) -> chunk_kda(kind=chunk, heads=2/2, +2 more)"
    assert len(narrow) == 81
    (narrower,) = site_lines(graph.format(width=80))
    assert narrower == "  rewritten   layers.0.attn (m.py:1) -> chunk_kda(kind=chunk, +3 more)"


def test_default_form_cuts_long_reasons_and_verbose_keeps_them():
    reason = "attention refuses the arguments: " + "a mask of an unexpected shape " * 10
    graph = GraphReport("0/0", left_alone=(LeftAlone("softmax_attention", "layers.2.attn", "m.py:9", reason),))
    (short,) = [line for line in graph.summary().splitlines() if line.startswith("  left alone")]
    assert len(short) == WIDTH and short.endswith("...")
    assert f"  left alone  layers.2.attn (m.py:9): {reason}" in graph.format(verbose=True).splitlines()
    assert str(Report((graph,))).splitlines()[-1].startswith("(lines cut to 160 characters")
    assert "(lines cut" not in Report((graph,)).format(verbose=True)


def test_disabled_lines_per_config():
    a = GraphReport("0/0", disabled=("sdpa_attention",))
    b = GraphReport("1/0", disabled=())
    c = GraphReport("2/0", disabled=("sdpa_attention",))
    assert "disabled" not in str(Report((b,)))
    assert str(Report((a, c))).splitlines()[-1] == "disabled: sdpa_attention"
    assert "disabled in graph(s) 0/0, 2/0: sdpa_attention" in str(Report((a, b, c))).splitlines()


def test_pass_manager_records_what_the_config_switched_off():
    from kda_compile.passes import PassManager

    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert PassManager(Config()).run(gm).disabled == ()
    off = PassManager(Config(softmax_attention=False, attention_mask_to_flags=False, capture_data_dependent_ops=False))
    assert off.run(gm).disabled == ("softmax_attention", "attention_mask_to_flags")


# ---------------------------------------------------------------------------------------------
# Names of traced frames
# ---------------------------------------------------------------------------------------------
class _Decorated(torch.nn.Module):
    def forward(self, x):
        return x


def _wrap(fn):
    def wrapper(self, *args):
        return fn(self, *args)
    return wrapper


_Decorated.forward = _wrap(_Decorated.forward)


def test_frame_names():
    def step(x):
        return x

    layer = _Decorated()
    assert frame_of(_Decorated.forward.__code__, layer).name == "_Decorated.forward"  # a decorator's code
    assert frame_of(step.__code__).name == "test_frame_names.<locals>.step"
    resumed = step.__code__.replace(co_name="torch_dynamo_resume_in_step_at_12")
    frame = frame_of(resumed)
    assert frame.name == "step, resumed at line 12" and frame.resumed and frame.code_name == "step"
    assert frame_of(_Decorated.forward.__code__.replace(co_name="torch_dynamo_resume_in_wrapper_at_7"),
                    layer).name == "_Decorated.forward, resumed at line 7"


# ---------------------------------------------------------------------------------------------
# report() of torch.compile(..., backend="kda_compile")
# ---------------------------------------------------------------------------------------------
def test_report_of_a_model_compiled_with_the_backend_name(quick_default_backend):
    model = tiny_llama(layers=2)
    compiled = torch.compile(model, backend="kda_compile")
    assert report(compiled).graphs == ()  # compiled, not run yet: nothing traced
    run(compiled)
    got = report(compiled)
    assert len(got.graphs) == 1 and got.graphs[0].function == "LlamaForCausalLM.forward"
    assert len(got.graphs[0].sites()) == 2
    assert str(got).startswith(f"graph {got.graphs[0].graph} of LlamaForCausalLM.forward: 2 site(s) rewritten")
    assert report(model).graphs == got.graphs  # the model given to torch.compile, once it ran


def test_reports_of_several_backend_compiled_models_are_their_own(quick_default_backend):
    one, two = tiny_llama(layers=1), tiny_llama(layers=2)
    first, second = torch.compile(one, backend="kda_compile"), torch.compile(two, backend="kda_compile")
    run(first)
    run(second)
    assert [len(g.sites()) for g in report(first).graphs] == [1]
    assert [len(g.sites()) for g in report(second).graphs] == [2]
    assert len(kda_compile.report().graphs) >= 2
    # another instance of a class Dynamo already traced runs those graphs, without a trace of its own
    twin = tiny_llama(layers=1)
    third = torch.compile(twin, backend="kda_compile")
    run(third)
    got = report(third)
    assert got.graphs == () and "another LlamaForCausalLM" in str(got), str(got)


def test_report_of_a_compiled_module_method_and_in_place_compile(quick_default_backend):
    model = tiny_llama(heads=8)
    model.forward = torch.compile(model.forward, backend="kda_compile")
    run(model)
    assert [g.function for g in report(model.forward).graphs] == ["LlamaForCausalLM.forward"]
    assert report(model).graphs == report(model.forward).graphs
    other = tiny_llama(heads=2)
    other.compile(backend="kda_compile")
    run(other)
    (graph,) = report(other).graphs
    assert graph.rewritten[0].details["heads"] == "2/2"


def test_report_of_a_compiled_function_follows_its_graph_breaks(quick_default_backend):
    def attend(q, k, v):
        out = torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1) @ v
        torch._dynamo.graph_break()
        return torch.softmax(out @ k.transpose(-1, -2) * 0.25, dim=-1) @ v

    def other(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1) @ v

    q = torch.randn(1, 2, 4, 16)
    compiled, unrelated = torch.compile(attend, backend="kda_compile"), torch.compile(other, backend="kda_compile")
    compiled(q, q, q)
    unrelated(q, q, q)
    names = [g.function for g in report(compiled).graphs]
    assert len(names) == 2 and names[0].endswith("attend") and re.fullmatch(r"attend, resumed at line \d+", names[1])
    assert [g.function.rsplit(".", 1)[-1] for g in report(unrelated).graphs] == ["other"]


def test_report_refuses_a_model_compiled_with_another_backend():
    compiled = torch.compile(torch.nn.Linear(2, 2), backend="eager")
    with pytest.raises(ValueError, match="compiled with backend 'eager'"):
        report(compiled)
    with pytest.raises(ValueError, match="model must be a model returned by kda_compile.optimize"):
        report(torch.nn.Linear(2, 2))


def test_an_op_fallback_with_a_long_reason_is_cut_in_the_default_form_only():
    from kda_compile.ops._common import clear_fallback_events, record_fallback
    from kda_compile.report import report

    clear_fallback_events()
    reason = "our Triton kernels failed to compile: OutOfResources: out of resource: shared memory, " * 3
    record_fallback("chunk_kda", "reference", reason)
    try:
        text, full = str(report()), report().format(verbose=True)
    finally:
        clear_fallback_events()
    (short,) = [line for line in text.splitlines() if line.startswith("fallback: chunk_kda")]
    assert len(short) <= WIDTH and short.endswith("...")
    assert reason.strip() in full
