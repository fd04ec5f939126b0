"""The ``kda_compile`` backend: registration, mode/options to Inductor, reports, and (slow) an
Inductor end-to-end run on a tiny Llama."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
import transformers

import kda_compile
from kda_compile.backend import BACKEND_NAME, KdaCompileBackend, inductor_config_patches, kda_compile_backend
from kda_compile.config import Config
from kda_compile.report import clear_reports


def attention(q, k, v):
    w = torch.matmul(q, k.transpose(2, 3)) * 0.25
    return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


def qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, 5, 16, generator=g) for _ in range(3)]


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def run_fresh(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_entry_point_resolves_the_name_without_importing_the_package():
    out = run_fresh("""
        import sys, torch
        fn = torch._dynamo.lookup_backend("kda_compile")
        assert "kda_compile" in sys.modules  # loaded by the entry point, not by us
        import kda_compile  # importing again must not register the name twice
        from kda_compile.backend import kda_compile_backend
        print(fn is kda_compile_backend)
    """)
    assert out.strip() == "True"


def test_import_then_lookup_gives_one_registration():
    out = run_fresh("""
        import kda_compile, torch
        from kda_compile.backend import kda_compile_backend, register_if_unknown
        register_if_unknown()  # a second call is a no-op
        print(torch._dynamo.lookup_backend("kda_compile") is kda_compile_backend)
    """)
    assert out.strip() == "True"


def test_name_is_listed():
    assert BACKEND_NAME in torch._dynamo.list_backends(exclude_tags=())


def test_mode_and_options_become_inductor_config():
    patches = inductor_config_patches("max-autotune-no-cudagraphs", {"epilogue_fusion": False})
    assert patches["max_autotune"] is True and patches["epilogue_fusion"] is False
    assert inductor_config_patches(None, None) == {} and inductor_config_patches("default", None) == {}
    # options win over the mode's defaults
    assert inductor_config_patches("max-autotune", {"max_autotune": False})["max_autotune"] is False


@pytest.mark.parametrize("mode, options, error, words", [
    ("fastest", None, ValueError, "mode must be one of"),
    (None, {"no_such_option": 1}, ValueError, "no_such_option"),
    (None, ["epilogue_fusion"], TypeError, "options must be a dict"),
])
def test_bad_mode_or_options_are_refused(mode, options, error, words):
    with pytest.raises(error, match=words):
        inductor_config_patches(mode, options)


@pytest.mark.parametrize("compile_kwargs, expected", [
    (dict(mode="max-autotune-no-cudagraphs"), {"max_autotune": True}),
    (dict(options={"epilogue_fusion": False}), {"epilogue_fusion": False}),
])
def test_torch_compile_passes_mode_and_options_to_inductor(monkeypatch, compile_kwargs, expected):
    import torch._inductor.compile_fx as inductor_compile_fx

    seen = {}

    def fake_compile_fx(gm, example_inputs, config_patches=None):
        seen.update(config_patches)
        return gm.forward

    monkeypatch.setattr(inductor_compile_fx, "compile_fx", fake_compile_fx)
    torch._dynamo.reset()
    compiled = torch.compile(attention, backend="kda_compile", **compile_kwargs)
    q, k, v = qkv()
    torch.testing.assert_close(compiled(q, k, v), attention(q, k, v), rtol=1e-5, atol=1e-6)
    assert expected.items() <= seen.items()


def test_backend_records_a_report_per_graph():
    clear_reports()
    backend = KdaCompileBackend(Config(compiler="aot_eager"))
    torch._dynamo.reset()
    q, k, v = qkv()
    out = torch.compile(attention, backend=backend)(q, k, v)
    torch.testing.assert_close(out, attention(q, k, v), rtol=1e-5, atol=1e-6)
    (graph,) = backend.reports
    assert len(graph.rewritten) == 1 and kda_compile.report().graphs[-1] is graph


def test_backend_refuses_a_wrong_config():
    with pytest.raises(TypeError, match="config must be a kda_compile.Config"):
        KdaCompileBackend({"softmax_attention": True})


@pytest.mark.slow
def test_inductor_end_to_end_on_a_tiny_llama():
    """backend="kda_compile" with Inductor: the generated code calls our op; logits match eager."""
    from torch._inductor.utils import run_and_get_code

    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    clear_reports()
    compiled = torch.compile(model, backend="kda_compile")
    with torch.no_grad():
        out, code = run_and_get_code(lambda: compiled(ids).logits)
        ref = model(ids).logits
    assert float((out - ref).norm() / ref.norm()) < 1e-5
    assert "kda_compile.attention_fwd" in "\n".join(code)
    assert len(kda_compile.report().graphs[-1].rewritten) == 2
    assert kda_compile_backend is torch._dynamo.lookup_backend("kda_compile")


def test_glm5_next_through_the_backend_gets_the_graphs_optimize_gets():
    """glm5_next's MoE routing (data-dependent) used to break the backend's graphs in 13 and leave its DSA
    attention dense; the backend now captures it as optimize() does: one graph, the same rewrites, eager's logits."""
    import sys

    transformers = pytest.importorskip("transformers")
    import kda_compile
    from kda_compile.coverage.models import shrink
    from kda_compile.passes.substitution.install import hf_torch_path
    from kda_compile.report import clear_reports

    if not hasattr(transformers, "Glm5NextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Glm5NextConfig")
    config = shrink(transformers.Glm5NextConfig().to_dict())
    for key in ("transformers_version", "architectures", "_name_or_path"):
        config.pop(key, None)
    torch.manual_seed(0)
    model = transformers.Glm5NextForConditionalGeneration._from_config(
        transformers.Glm5NextConfig.from_dict(config), attn_implementation="eager").eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_()
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    modeling = sys.modules[type(model).__module__]
    names = [n for n in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
                         "causal_conv1d_update") if hasattr(modeling, n)]
    torch._dynamo.reset()
    clear_reports()
    with torch.no_grad(), hf_torch_path(modeling, *names):
        want = model(input_ids=ids, use_cache=False).logits
        compiled = torch.compile(model, backend="kda_compile")
        got = compiled(input_ids=ids, use_cache=False).logits
    report = kda_compile.report(compiled)
    assert float((got - want).norm() / want.norm()) < 1e-4
    assert len(report.graphs) == 1 and not report.left_alone, str(report)
    ops = [r.op for r in report.rewritten]
    assert "kda_compile.dsa_sparse_attention" in ops and "kda_compile.dsa_pooled_indexer_topk" in ops, ops
    torch._dynamo.reset()
