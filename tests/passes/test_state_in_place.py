"""The decode-state rewrite (passes/delta_rule/state_in_place.py): a KDA / GDN decode step whose final state is
copied back into the tensor it read its initial state from writes that state in place, and the copy is gone.

Each case compiles a decode step written as Hugging Face writes it (the public decode function, then
``state.copy_(final)``) with the passes and aot_eager, and compares the output and the state it leaves with the
same step run eagerly from the same state: the in-place op runs the same kernel on the same inputs, so they are
equal to the bit. Models: the tiny KDA and GDN families decode with the rewrite and give eager's tokens.
"""
from __future__ import annotations

import sys

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

from kda_compile.config import Config
from kda_compile.ops import fused_recurrent_gated_delta_rule, fused_recurrent_kda
from kda_compile.passes import PassManager
from kda_compile.testing import KDAShape, make_gdn_args, make_kda_args

from hf_kda_binding import torch_path

from .families import build_qwen3_next
from .graph_capture import GraphCapture

REWRITE = "delta_rule_state_in_place"
SHAPE = KDAShape(2, 1, 2, 4, 16, 32)
HF_TORCH_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                      "causal_conv1d_update")  # what an installed FLA / causal-conv1d would have bound  # B, T, H, HV, K, V: one decode token, grouped value heads


def ours(report):
    return [r for r in report.rewritten if r.rewrite == REWRITE], [c for c in report.left_alone if c.rewrite == REWRITE]


def kda_step(q, k, v, g, beta, A_log, dt_bias, state):
    o, final = fused_recurrent_kda(q, k, v, g, beta, A_log, dt_bias, initial_state=state, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                   use_beta_sigmoid_in_kernel=True)
    state.copy_(final.to(torch.float32))  # Kimi-Linear's update_recurrent_state(final.to(torch.float32))
    return o


def gdn_step(q, k, v, g, beta, A_log, dt_bias, state):
    o, final = fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=state, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                                                dt_bias=dt_bias)
    state.copy_(final)
    return o


def step_inputs(gdn: bool, seed: int = 0):
    make = make_gdn_args if gdn else make_kda_args
    a = make(SHAPE, seed=seed, gate_form="in_kernel" if gdn else "softplus", initial_state=True)
    return [a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"], a["initial_state"]]


def run_both(step, inputs, capture):
    """(compiled o, compiled state, eager o, eager state), each from its own copy of the initial state."""
    eager_state, compiled_state = inputs[-1].clone(), inputs[-1].clone()
    want = step(*inputs[:-1], eager_state)
    got = torch.compile(step, backend=capture, fullgraph=True)(*inputs[:-1], compiled_state)
    return got, compiled_state, want, eager_state


@pytest.mark.parametrize("step, gdn", [(kda_step, False), (gdn_step, True)], ids=["kda", "gdn"])
def test_the_copy_back_becomes_a_write_in_place(step, gdn, fresh_dynamo):
    capture = GraphCapture()
    got, got_state, want, want_state = run_both(step, step_inputs(gdn), capture)
    assert torch.equal(got, want) and torch.equal(got_state, want_state)
    rewritten, left = ours(capture.reports[0])
    assert len(rewritten) == 1 and not left, capture.reports[0].format(verbose=True)
    assert capture.after[0].count("copy_", torch.Tensor.copy_) == 0
    assert "inplace_final_state = True" in capture.after[0].code


def test_a_second_run_leaves_the_graph_as_it_is(fresh_dynamo):
    reports = []

    def twice(gm, example_inputs):
        reports.extend(PassManager(Config(compiler="aot_eager")).run(gm) for _ in range(2))
        return lookup_backend("aot_eager")(gm, example_inputs)

    got, got_state, want, want_state = run_both(gdn_step, step_inputs(True), twice)
    assert torch.equal(got, want) and torch.equal(got_state, want_state)
    assert len(ours(reports[0])[0]) == 1 and ours(reports[1]) == ([], [])


def test_a_state_read_before_the_copy_back_is_left_alone_and_reported(fresh_dynamo):
    def step(q, k, v, g, beta, A_log, dt_bias, state):
        o, final = fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=state,
                                                    output_final_state=True, use_gate_in_kernel=True, A_log=A_log,
                                                    dt_bias=dt_bias)
        before = state.sum()  # the old state, read after the step: in place it would read the new one
        state.copy_(final)
        return o, before

    capture = GraphCapture()
    (got, got_before), got_state, (want, want_before), want_state = run_both(step, step_inputs(True), capture)
    assert torch.equal(got, want) and torch.equal(got_state, want_state) and torch.equal(got_before, want_before)
    rewritten, left = ours(capture.reports[0])
    assert not rewritten and len(left) == 1
    assert "is also used by" in left[0].reason and "before the copy back" in left[0].reason


def test_a_step_that_needs_gradients_is_not_rewritten(fresh_dynamo):
    """Traced with grad mode on and an input requiring grad, the step is the differentiable chunked op, which
    saves the state the copy overwrites for its backward: not a decode call, nothing rewritten. (The graph runs
    as traced: a backward through a state overwritten by the copy back fails in eager PyTorch as it would here.)"""
    reports = []

    def passes_only(gm, example_inputs):
        reports.append(PassManager(Config(compiler="eager")).run(gm))
        return gm.forward

    inputs = step_inputs(False)
    inputs[0].requires_grad_()
    got, got_state, want, want_state = run_both(kda_step, inputs, passes_only)
    assert torch.equal(got_state, want_state) and torch.equal(got, want)
    assert ours(reports[0]) == ([], [])


def test_a_final_state_not_copied_back_is_not_a_candidate(fresh_dynamo):
    def step(q, k, v, g, beta, A_log, dt_bias, state):
        return fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=state, output_final_state=True,
                                                use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)

    inputs = step_inputs(True)
    capture = GraphCapture()
    got = torch.compile(step, backend=capture, fullgraph=True)(*inputs)
    want = step(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert ours(capture.reports[0]) == ([], [])


def test_switched_off_the_copy_stays(fresh_dynamo):
    capture = GraphCapture(Config(compiler="aot_eager", delta_rule_state_in_place=False))
    got, got_state, want, want_state = run_both(gdn_step, step_inputs(True), capture)
    assert torch.equal(got, want) and torch.equal(got_state, want_state)
    assert ours(capture.reports[0]) == ([], [])
    assert capture.after[0].count("copy_", torch.Tensor.copy_) == 1
    assert REWRITE in capture.reports[0].disabled


def test_a_tiny_qwen3_next_decodes_with_its_state_written_in_place(fresh_dynamo):
    """generate() through the rewritten decode graph gives eager's tokens; the decode graph's GDN layer is
    rewritten (tiny config, static cache, aot_eager)."""
    import kda_compile
    from kda_compile.passes import manager

    model = build_qwen3_next()
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    # HF's torch path on these CPU tensors, where an installed FLA would have bound its CUDA kernels
    modeling = sys.modules[type(model).__module__]
    names = [n for n in HF_TORCH_FUNCTIONS if hasattr(modeling, n)]
    with torch.no_grad(), torch_path(modeling, *names):
        want = model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="static")
    reports = []
    run = manager.PassManager.run

    def recording(self, gm, graph=""):
        reports.append(run(self, gm, graph))
        return reports[-1]

    manager.PassManager.run = recording
    try:
        model.forward = kda_compile.optimize(model.forward, Config(compiler="aot_eager"))
        with torch.no_grad(), torch_path(modeling, *names):
            got = model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="static")
    finally:
        manager.PassManager.run = run
    assert torch.equal(got, want)
    rewritten = [r for report in reports for r in ours(report)[0]]
    assert [r.site for r in rewritten] == ["model.layers.0.linear_attn"], [str(r) for r in rewritten]
