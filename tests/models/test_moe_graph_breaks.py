"""Model-side MoE code under ``kda_compile.optimize``: data-dependent routing captured, not broken.

Checked (cheap): a MoE block written as Hugging Face writes its routing (``nonzero`` of the experts
hit, ``torch.where`` of a mask, ``.item()`` / ``.tolist()`` of counts) breaks Dynamo's graph with
``Config(capture_data_dependent_ops=False)`` (the report names each break: model line and Dynamo's
reason) and compiles into one graph without a break by default, with the output of eager
(fp32 relative error < 1e-6); Dynamo's config is switched only during the calls; a break capture
cannot remove (a Python branch on a data-dependent value) stays, named in the report.

Slow (``-m slow``): tiny jetmoe, longcat_flash and dbrx models (families whose data-dependent code
broke graphs): breaks counted before and after, logits as eager, the remaining breaks named with their
model line. (glm5_next's MoE runs HF's experts interface, which does not break; its breaks came from its
block-sparse indexer's ``nonzero``. qwen4_exp_text's MoE runs that interface too; its breaks came from its
QSA indexer's ``nonzero`` and ``if num_complete_blocks > 0``, which kda_compile traces branch-free, with or
without capture: passes/dsa/qsa_indexer.py, tests/models/test_qwen4_exp_indexer.py.)
"""
from __future__ import annotations

import pytest
import torch

from kda_compile import Config, optimize, report
from kda_compile.testing import rel_error

QUICK = Config(compiler="aot_eager")
OFF = Config(compiler="aot_eager", capture_data_dependent_ops=False)
CAPTURE_FLAGS = ("capture_scalar_outputs", "capture_dynamic_output_shape_ops")


class TinyMoE(torch.nn.Module):
    """Top-2 routing over 4 experts, tokens grouped per expert by counts read back with ``.tolist()``
    (JetMoE's dispatch), plus the tokens of a confident route picked with ``nonzero``."""

    def __init__(self, hidden=16, experts=4):
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.up = torch.nn.Parameter(torch.randn(experts, hidden, hidden) / hidden ** 0.5)

    def forward(self, x):
        weights, chosen = torch.topk(self.router(x).softmax(-1), 2, dim=-1)
        flat = chosen.reshape(-1)
        order = flat.argsort()
        token = torch.div(torch.arange(flat.numel()), 2, rounding_mode="floor")[order]
        hits = torch.zeros(x.shape[0], self.up.shape[0], dtype=torch.long).scatter(1, chosen, 1)
        sizes = hits.sum(0).tolist()                                               # data-dependent scalars
        parts = torch.split(x[token], sizes)
        routed = torch.cat([part @ self.up[e] for e, part in enumerate(parts)]) * weights.reshape(-1)[order, None]
        out = torch.zeros_like(x).index_add_(0, token, routed)
        confident = (weights[:, 0] > 0.5).nonzero().squeeze(-1)                     # data-dependent shape
        return out.index_add(0, confident, x[confident])


def breaks_of(model) -> int:
    return sum(b.count for b in report(model).graph_breaks)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield


def test_moe_routing_breaks_without_capture_and_the_report_names_it():
    torch.manual_seed(0)
    moe, x = TinyMoE().eval(), torch.randn(8, 16)
    compiled = optimize(moe, OFF)
    with torch.no_grad():
        assert rel_error(compiled(x), moe(x)) < 1e-6
    found = report(moe).graph_breaks
    assert found and all(b.location.startswith("test_moe_graph_breaks.py:") for b in found)
    assert any("nonzero" in b.reason or "data" in b.reason.lower() for b in found), found
    assert "graph break at test_moe_graph_breaks.py:" in str(report(moe))


def test_moe_routing_is_captured_by_default():
    torch.manual_seed(0)
    moe, x = TinyMoE().eval(), torch.randn(8, 16)
    compiled = optimize(moe, QUICK)
    with torch.no_grad():
        assert rel_error(compiled(x), moe(x)) < 1e-6
        other = torch.randn(8, 16)
        assert rel_error(compiled(other), moe(other)) < 1e-6  # other experts hit: same graph, no guard on them
    assert report(moe).graph_breaks == ()
    assert len(report(moe).graphs) == 1
    for flag in CAPTURE_FLAGS:  # switched on for the calls only
        assert getattr(torch._dynamo.config, flag) is False


def test_user_setting_is_kept():
    torch.manual_seed(0)
    moe, x = TinyMoE().eval(), torch.randn(8, 16)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        with torch.no_grad():
            optimize(moe, OFF)(x)
        assert torch._dynamo.config.capture_scalar_outputs is True
    assert torch._dynamo.config.capture_scalar_outputs is False


def test_a_compile_error_under_capture_says_how_to_turn_it_off():
    def grouped_by_bincount(x, chosen):
        sizes = torch.bincount(chosen, minlength=4).tolist()  # bincount's length is data-dependent
        return torch.cat([part.sum(0, keepdim=True) for part in torch.split(x[chosen.argsort()], sizes)])

    x, chosen = torch.randn(6, 3), torch.tensor([0, 2, 1, 2, 3, 0])
    with pytest.raises(Exception, match="data-dependent") as caught:
        optimize(grouped_by_bincount, QUICK)(x, chosen)
    assert any("capture_data_dependent_ops=False" in note for note in getattr(caught.value, "__notes__", []))
    torch._dynamo.reset()
    assert torch.allclose(optimize(grouped_by_bincount, OFF)(x, chosen), grouped_by_bincount(x, chosen))


def test_a_break_capture_cannot_remove_is_reported():
    def branch_on_data(x):
        if x.sum().item() > 0:  # a Python branch on a data-dependent value
            return x * 2
        return x - 1

    compiled = optimize(branch_on_data, QUICK)
    x = torch.ones(4)
    assert torch.equal(compiled(x), branch_on_data(x))
    found = report(compiled).graph_breaks
    assert len(found) >= 1 and found[0].location.startswith("test_moe_graph_breaks.py:")
    assert "data-dependent" in found[0].reason


class LoopOverExpertsHit(torch.nn.Module):
    """dbrx / longcat_flash's dispatch: a Python loop over ``nonzero()`` of the experts hit, whose length
    is data-dependent even when ``nonzero`` is captured."""

    def __init__(self, hidden=16, experts=4):
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.up = torch.nn.Parameter(torch.randn(experts, hidden, hidden) / hidden ** 0.5)

    def forward(self, x):
        weights, chosen = torch.topk(self.router(x).softmax(-1), 2, dim=-1)
        expert_mask = torch.nn.functional.one_hot(chosen, num_classes=self.up.shape[0]).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        out = torch.zeros_like(x)
        for expert_idx in expert_hit:  # the loop's length is the number of experts hit
            expert_idx = expert_idx[0]
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            routed = (x[token_idx] @ self.up[expert_idx]) * weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, routed)
        return out


def test_a_loop_over_the_experts_hit_is_named_with_its_line_and_reason():
    torch.manual_seed(0)
    moe, x = LoopOverExpertsHit().eval(), torch.randn(8, 16)
    with torch.no_grad():
        assert rel_error(optimize(moe, QUICK)(x), moe(x)) < 1e-6
    found = report(moe).graph_breaks
    loop = [b for b in found if "for expert_idx in expert_hit" in b.reason]
    assert loop, str(report(moe))
    line = loop[0].location
    assert line.startswith("test_moe_graph_breaks.py:") and all(b.location == line for b in loop)
    assert all("data-dependent" in b.reason for b in loop)
    assert f"graph break at {line}" in str(report(moe))


# ----------------------------------------------------------------------------------------------
# Hugging Face families (slow: 10 to 60 s of Dynamo tracing each on 2 CPU cores)
# ----------------------------------------------------------------------------------------------
def _coverage_model(family):
    from kda_compile.coverage.models import build_model

    return lambda: build_model(family)


# family -> (model factory, whether breaks remain with capture on: a loop over the experts hit)
FAMILIES = {
    "jetmoe": (_coverage_model("jetmoe"), False),
    "longcat_flash": (_coverage_model("longcat_flash"), True),  # for expert_idx_tensor in expert_hit
    "dbrx": (_coverage_model("dbrx"), True),             # for expert_idx in expert_hit (unbacked length)
}


MODELING = {"jetmoe": "jetmoe", "longcat_flash": "longcat_flash", "dbrx": "dbrx"}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_moe_family_breaks_before_and_after(family):
    make, remain = FAMILIES[family]
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    counts = {}
    for config in (OFF, QUICK):
        model = make()
        torch._dynamo.reset()
        with torch.no_grad():
            want = model(input_ids=ids, use_cache=False).logits
            got = optimize(model, config)(input_ids=ids, use_cache=False).logits
        assert rel_error(got, want) < 1e-5
        counts[config.capture_data_dependent_ops] = breaks_of(model)
        if config is QUICK and remain:
            found = report(model).graph_breaks
            assert all(".py:" in b.location and b.reason for b in found)
            # the model's own routing line is named, with Dynamo's data-dependent reason
            own = [b for b in found if b.location.startswith(f"modeling_{MODELING[family]}.py:")]
            assert own and any("data-dependent" in b.reason for b in own), str(report(model))
    assert counts[False] > 0
    assert (counts[True] > 0) == remain, counts
