"""The KDA site report (passes/substitution/sites.py) of the substituted entry points: each site, its entry
point and source line; an unsubstituted reference left alone; the report pass changes nothing."""
from __future__ import annotations

import types

import torch

from kda_compile import Config
from kda_compile.passes.substitution.sites import report_substitution_sites
from kda_compile.passes.rewrite import REWRITES, RewriteLog

from .kda_substitution_helpers import compile_call, hf, inputs, kda_ops, wrapper_entry


def test_report_names_sites_entry_points_and_source_lines():
    (q, k, v, g, beta), h0 = inputs(T=8)

    def layer(q, k, v, g, beta, h0):
        o1, s = hf.chunk_kimi_delta_attention(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
        return hf.recurrent_kimi_delta_attention(q[:, :1], k[:, :1], v[:, :1], g=g[:, :1], beta=beta[:, :1],
                                                 initial_state=s, output_final_state=False)[0] + o1[:, :1]

    _, cap = compile_call(layer, q, k, v, g, beta, h0)
    chunk, recurrent = cap.reports[-1].rewritten
    line = layer.__code__.co_firstlineno
    assert chunk.op == "kda_compile.chunk_kda_fwd" and chunk.source == f"test_kda_sites.py:{line + 1}"
    assert chunk.details["entry"] == wrapper_entry("chunk_kimi_delta_attention")
    assert chunk.details["kind"] == "chunk" and chunk.details["heads"] == "2/2" and chunk.details["K"] == 16
    assert chunk.details["use_qk_l2norm_in_kernel"] is True and chunk.details["initial_state"] is True
    assert chunk.details["lower_bound"] is None and chunk.details["output_final_state"] is True
    assert recurrent.op == "kda_compile.fused_recurrent_kda_fwd" and recurrent.details["kind"] == "recurrent"
    assert recurrent.details["entry"] == wrapper_entry("recurrent_kimi_delta_attention")
    assert recurrent.source == f"test_kda_sites.py:{line + 3}"
    assert recurrent.details["output_final_state"] is False


def test_report_lists_an_unsubstituted_reference():
    original = hf.recurrent_kimi_delta_attention.__wrapped__
    unregistered = types.FunctionType(original.__code__, original.__globals__, original.__name__,
                                      original.__defaults__, original.__closure__)
    (q, k, v, g, beta), h0 = inputs(T=3)
    call = lambda *a: unregistered(*a[:5], a[5], True)  # noqa: E731
    # without the inline-recurrence rewrite, which would collapse the unrolled loop
    _, cap = compile_call(call, q, k, v, g, beta, h0, config=Config(compiler="aot_eager", kda_recurrence=False))
    report = cap.reports[-1]
    assert not report.rewritten and not kda_ops(cap)
    (left,) = [c for c in report.left_alone if c.rewrite == "kda_substitution"]
    assert "recurrent_kimi_delta_attention traced as written" in left.reason and left.rewrite == "kda_substitution"
    # with it (when registered): a collapsed loop is a site, not a candidate left alone
    if "kda_recurrence" in REWRITES:
        torch._dynamo.reset()
        _, cap = compile_call(call, q, k, v, g, beta, h0)
        ours = [r for r in cap.reports[-1].rewritten if r.rewrite == "kda_substitution"]
        assert not [c for c in cap.reports[-1].left_alone if c.rewrite == "kda_substitution"] and len(ours) == 1
        assert ours[0].details["entry"].startswith("graph rewrite (transformers recurrent_kimi_delta_attention")


def test_report_pass_changes_nothing():
    (q, k, v, g, beta), h0 = inputs(T=8)
    captured = []

    def keep(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    torch.compile(lambda *a: hf.chunk_kimi_delta_attention(*a[:5], initial_state=a[5]), backend=keep,
                  fullgraph=True)(q, k, v, g, beta, h0)
    gm = captured[-1]
    before = gm.code
    logs = [RewriteLog(), RewriteLog()]
    for log in logs:
        report_substitution_sites(gm, log)
    assert gm.code == before and logs[0].rewritten == logs[1].rewritten and len(logs[0].rewritten) == 1
