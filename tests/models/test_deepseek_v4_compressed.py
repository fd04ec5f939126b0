"""DeepSeek-V4's compressed attention layers (CSA, HCA) rewritten into ``compressed_sparse_attention``
(passes/dsa/compressed.py; docs/dsa.md, section 6): a tiny random ``DeepseekV4ForCausalLM`` (fp32, eager; a
sliding, a CSA and an HCA layer) gives HF eager's logits and ``generate()`` tokens, with a left-padded row, every
graph rewrites both compressed layers and leaves no dense bias over the compressed entries, and a site the
rewrite cannot read is reported with its reason."""
from __future__ import annotations

import pytest
import torch

import kda_compile
from kda_compile import Config
from kda_compile.passes import manager
from kda_compile.passes.toolkit.graph_tools import tensor_of
from kda_compile.testing import rel_error

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from tests.dsa.test_deepseek_v4_on_sparse_attention import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py
OP = "kda_compile.compressed_sparse_attention"
TOL = 1e-5  # fp32: our sparse attention against HF's dense softmax


def _rewritten(report) -> list[tuple[str, str]]:
    return sorted((r.site, r.details["kind"]) for g in report.graphs for r in g.rewritten if r.op == OP)


@pytest.fixture
def graphs(monkeypatch):
    """The graph modules the pass manager rewrote, in order."""
    seen, run = [], manager.PassManager.run

    def keep(self, gm, graph=""):
        report = run(self, gm, graph=graph)
        seen.append(gm)
        return report

    monkeypatch.setattr(manager.PassManager, "run", keep)
    return seen


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_prefill_gives_hf_logits_without_a_dense_compressed_bias(graphs, compiler):
    """The rewritten graph run as is and traced by AOTAutograd (the op's index lists and sparse attention under
    fake tensors)."""
    model = tiny_model()
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        fast = kda_compile.optimize(model, Config(compiler=compiler))
        got = fast(input_ids=ids, use_cache=False).logits
    report = kda_compile.report(fast)
    assert rel_error(got, want) < TOL
    assert _rewritten(report) == [("model.layers.1.self_attn", "csa"), ("model.layers.2.self_attn", "hca")]
    assert not [c for g in report.graphs for c in g.left_alone], str(report)
    # HF's [B, 1, S, Tc (+ 1)] biases and their concatenation with the window's [B, 1, S, S] mask are gone (CSA:
    # Tc = 20 / 4 = 5; HCA: 20 / 8 = 2)
    dense = {(tuple(t.shape), n.name) for n in graphs[0].graph.nodes for t in [tensor_of(n)]
             if t is not None and t.dim() == 4 and t.shape[1] == 1 and t.shape[-2] == 20
             and t.shape[-1] in (5, 6, 25, 2, 22)}
    assert not dense, dense


def test_generate_with_left_padding_gives_eager_tokens():
    """A 21-token batch of two, the first row left-padded, 8 new tokens with HF's cache: prefill and every decode
    graph rewrite the CSA and the HCA layer (the HCA decode step, whose mask HF zero-pads, sees every entry)."""
    model = tiny_model()
    ids = torch.randint(3, 64, (2, 21), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, **kwargs)
        model.forward = kda_compile.optimize(model.forward, Config(compiler="eager"))
        got = model.generate(ids, **kwargs)
    assert torch.equal(got, want)
    report = kda_compile.report(model.forward)
    assert len(report.graphs) >= 2
    for graph in report.graphs:
        kinds = sorted(r.details["kind"] for r in graph.rewritten if r.op == OP)
        assert kinds in (["csa", "hca"], ["csa", "every entry"]), graph.summary()
        assert not graph.left_alone, graph.summary()


def test_switched_off_the_layers_keep_the_dense_mask():
    model = tiny_model()
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fast = kda_compile.optimize(model, Config(compiler="eager", compressed_attention=False))
        fast(input_ids=ids, use_cache=False)
    report = kda_compile.report(fast)
    assert _rewritten(report) == [] and "compressed_attention" in report.graphs[0].disabled


def test_a_window_mask_it_cannot_read_is_reported():
    model = tiny_model()
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        fast = kda_compile.optimize(model, Config(compiler="eager", attention_mask_to_flags=False))
        got = fast(input_ids=ids, use_cache=False).logits
    report = kda_compile.report(fast)
    assert rel_error(got, want) < TOL
    reasons = [c.reason for g in report.graphs for c in g.left_alone if c.rewrite == "compressed_attention"]
    assert len(reasons) == 2 and all("attention_mask_to_flags is off" in r for r in reasons), str(report)
