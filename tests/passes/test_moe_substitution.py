"""passes/substitution/moe_experts.py: HF's grouped-GEMM experts traced as kda_compile.ops.moe_experts under optimize(), only for
the plain gated-SiLU form and without gradients; logits equal eager's."""
import logging

import pytest
import torch

pytest.importorskip("transformers")

import kda_compile  # noqa: E402
from kda_compile.ops.moe import custom_ops  # noqa: E402
from kda_compile.passes.substitution import moe_experts as moe_pass  # noqa: E402
from kda_compile.passes.substitution import substitutes  # noqa: E402

from .families import build_qwen3_next  # noqa: E402


@pytest.fixture
def expert_calls(monkeypatch):
    calls = []
    reference = custom_ops._KERNELS["reference"]
    monkeypatch.setitem(custom_ops._KERNELS, "reference", lambda *a: calls.append(tuple(a[0].shape)) or reference(*a))
    return calls


def test_qwen3_next_experts_run_as_the_op_with_eager_logits(expert_calls):
    model = build_qwen3_next()
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        want = model(ids).logits
        got = kda_compile.optimize(model.forward, kda_compile.Config(compiler="aot_eager"))(ids).logits
    assert expert_calls == [(14, 64), (14, 64)]  # one call per MoE layer, every token of the batch
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_report_lists_each_substituted_experts_module():
    model = build_qwen3_next()
    compiled = kda_compile.optimize(model.forward, kda_compile.Config(compiler="aot_eager"))
    with torch.no_grad():
        compiled(torch.randint(0, 128, (1, 5)))
    sites = [s for g in kda_compile.report(compiled).graphs for s in g.rewritten if s.op.endswith("moe_experts")]
    assert sorted(s.site for s in sites) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(s.source.startswith("modeling_qwen3_next.py:") for s in sites)
    assert sites[0].details == {"entry": "transformers grouped_mm_experts_forward", "experts": 8, "top_k": 2,
                                "H": 64, "I": 32, "dtype": "torch.float32"}
    assert "moe_experts(experts=8, top_k=2, H=64, I=32" in kda_compile.report(compiled).format()


def test_training_keeps_hf_grouped_gemm(expert_calls):
    model = build_qwen3_next().train()
    ids = torch.randint(0, 128, (1, 5))
    compiled = kda_compile.optimize(model.forward, kda_compile.Config(compiler="aot_eager"))
    compiled(ids).logits.sum().backward()
    assert expert_calls == []
    assert not [s for g in kda_compile.report(compiled).graphs for s in g.rewritten if s.op.endswith("moe_experts")]
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad is not None


class _Experts(torch.nn.Module):
    def __init__(self, **flags):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(3, 8, 4), requires_grad=False)
        self.down_proj = torch.nn.Parameter(torch.randn(3, 4, 4), requires_grad=False)
        self.act_fn = torch.nn.SiLU()
        self.__dict__.update(dict(has_gate=True, has_bias=False, is_transposed=False, is_concatenated=True,
                                  has_post_expert_norm=False, _is_expert_parallel=False) | flags)


@pytest.mark.parametrize("flags, reason", [
    ({}, None),
    ({"has_bias": True}, "has_bias is True"),
    ({"is_transposed": True}, "is_transposed is True"),
    ({"_is_expert_parallel": True}, "_is_expert_parallel is True"),
    ({"act_fn": torch.nn.GELU()}, "act_fn is GELU, not SiLU"),
])
def test_only_the_plain_gated_silu_form_is_substituted(flags, reason):
    from transformers.integrations import moe

    module = _Experts(**flags)
    _Experts._apply_gate = moe._default_apply_gate  # on the class, where HF's decorator puts it
    why = moe_pass.why_not_substituted(module, moe._default_apply_gate)
    assert (why is None) if reason is None else (reason in why), why


def test_a_declined_site_is_logged_once(caplog):
    with caplog.at_level(logging.INFO, logger="kda_compile.passes.kda_substitution"):
        for _ in range(2):
            substitutes._declined_once(moe_pass.ENTRY_POINT, "a reason only this test gives")
    assert [r.getMessage() for r in caplog.records].count(
        "transformers grouped_mm_experts_forward traced as written: a reason only this test gives") == 1
