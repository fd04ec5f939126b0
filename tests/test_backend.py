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
