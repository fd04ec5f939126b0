"""Trace-time substitution of the KDA entry points (passes/substitution/install.py, the substitutes in
passes/substitution/substitutes.py) for Hugging Face's torch references, and its switches.

Checked: Hugging Face's torch references (through HF's wrapper and called directly; Kimi-Linear's
KDA to the KDA ops, Qwen3-Next's gated delta rule to the GDN ops) trace to our op with one graph
and no unrolled loop, and match the references run eagerly (fp32 relative error
< 1e-5, both compute in fp32; bf16 < 1e-2 against the fp32 reference, outputs stay bf16, states
fp32); eager calls run the original code; the environment switch reads its documented values and
``Config(kda_substitution=False)`` traces the original code. FLA's entry points:
test_kda_substitution_fla.py; the KDA site report: test_kda_sites.py.

Where flash-linear-attention is installed, HF's wrappers bound FLA's functions at import, whose
Triton kernels need CUDA tensors: eager references here are always HF's torch references
(``wrapper.__wrapped__``, tests/hf_kda_binding.py); the ``wrapper`` cases then test the FLA-bound
wrapper under compile (our op against the torch reference) and expect the report entry of the
actual binding; a GDN wrapper bound to FLA is checked to be substituted too.
"""
from __future__ import annotations

import inspect
import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kda_compile import Config, optimize
from kda_compile.passes.substitution import install as kda_substitution, registry
from kda_compile.testing import rel_error
from hf_kda_binding import binding, torch_bound, torch_entry, torch_path, torch_reference

from .kda_substitution_helpers import (BF16_TOL, FP32_TOL, QUICK, compile_call, hf, inputs, kda_ops, kda_sites,
                                       wrapper_entry)


# ----------------------------------------------------------------------------------------------
# Hugging Face's torch references
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,op,T", [("chunk_kimi_delta_attention", "chunk_kda_fwd", 37),
                                       ("recurrent_kimi_delta_attention", "fused_recurrent_kda_fwd", 1),
                                       ("recurrent_kimi_delta_attention", "fused_recurrent_kda_fwd", 5)])
@pytest.mark.parametrize("through", ["wrapper", "__wrapped__"])
@pytest.mark.parametrize("with_state", [True, False])
def test_hf_reference_becomes_our_op(name, op, T, through, with_state):
    """Through HF's wrapper (bound to the torch reference, or to FLA where FLA is installed) and
    the torch reference called directly; the eager reference is HF's torch function."""
    wrapper = getattr(hf, name)
    fn = wrapper if through == "wrapper" else wrapper.__wrapped__
    (q, k, v, g, beta), h0 = inputs(T=T, state=with_state)

    def call(q, k, v, g, beta, h0, fn=fn):  # as KimiLinearDeltaAttention.forward calls it (plus a stray kwarg)
        return fn(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=with_state,
                  use_qk_l2norm_in_kernel=True, position_ids=None)

    (o, state), cap = compile_call(call, q, k, v, g, beta, h0)
    o_ref, state_ref = call(q, k, v, g, beta, h0, fn=torch_reference(wrapper))
    assert kda_ops(cap) == [op], cap.before[-1].code
    (site,) = kda_sites(cap)
    assert site.details["entry"] == (wrapper_entry(name) if through == "wrapper" else f"transformers {name}")
    assert "cumsum" not in cap.before[-1].code and "eye" not in cap.before[-1].code
    assert o.dtype == torch.float32 and rel_error(o, o_ref) < FP32_TOL
    if with_state:
        assert state.dtype == torch.float32 and rel_error(state, state_ref) < FP32_TOL
    else:
        assert state is None and state_ref is None


@pytest.mark.parametrize("name", ["chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"])
@pytest.mark.parametrize("through", ["wrapper", "__wrapped__"])
def test_hf_bf16_outputs_and_states(name, through):
    """bf16 inputs: bf16 outputs, float32 states, close to HF's torch reference in fp32. HF's torch
    reference takes a bf16 initial state (it casts it); FLA's functions take float32 states only
    (FLA's chunk_kda asserts it; HF hands them its float32 cache), so a wrapper bound to FLA gets
    a float32 one."""
    (q, k, v, g, beta), h0 = inputs(T=20)
    wrapper = getattr(hf, name)
    fn = wrapper if through == "wrapper" else wrapper.__wrapped__
    state_dtype = torch.bfloat16 if through == "__wrapped__" or torch_bound(wrapper) else torch.float32

    def call(q, k, v, g, beta, h0, fn=fn):
        return fn(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)

    (o, state), cap = compile_call(call, *(x.bfloat16() for x in (q, k, v, g, beta)), h0.to(state_dtype))
    o_ref, state_ref = call(q, k, v, g, beta, h0, fn=torch_reference(wrapper))  # fp32 reference
    assert kda_ops(cap)
    assert o.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert rel_error(o, o_ref) < BF16_TOL and rel_error(state, state_ref) < BF16_TOL


def test_hf_chunk_size_and_scale_mapping():
    """chunk_size 16 reaches the op; 48 (which our op does not tile) gives the same math with 64;
    the scale is always K ** -0.5, as in HF's reference."""
    (q, k, v, g, beta), h0 = inputs(T=50, K=12)
    for chunk_size in (16, 48):
        call = lambda *a, c=chunk_size: hf.chunk_kimi_delta_attention.__wrapped__(  # noqa: E731
            *a[:5], chunk_size=c, initial_state=a[5], output_final_state=True)
        (o, state), cap = compile_call(call, q, k, v, g, beta, h0)
        o_ref, state_ref = call(q, k, v, g, beta, h0)
        assert rel_error(o, o_ref) < FP32_TOL and rel_error(state, state_ref) < FP32_TOL
        (site,) = cap.reports[-1].rewritten
        assert site.details["scale"] == pytest.approx(12 ** -0.5)


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("through", ["wrapper", "__wrapped__"])
def test_eager_calls_run_the_original_code(through):
    """Both substituted objects run HF's torch code eagerly. A wrapper bound to FLA runs FLA's
    function eagerly, whose kernels need CUDA: that case is checked with a fake FLA
    (test_hf_wrapper_bound_to_fla_is_substituted) and skipped here."""
    chunk, recurrent = hf.chunk_kimi_delta_attention, hf.recurrent_kimi_delta_attention
    if through == "wrapper" and not (torch_bound(chunk) and torch_bound(recurrent)):
        pytest.skip(f"HF's Kimi wrappers are bound to {binding(chunk)} / {binding(recurrent)} (FLA's kernels "
                    "need CUDA tensors)")
    if through == "__wrapped__":
        chunk, recurrent = chunk.__wrapped__, recurrent.__wrapped__
    (q, k, v, g, beta), h0 = inputs(T=9)
    with RecordOps() as rec:
        chunk(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True)
        recurrent(q[:, :1], k[:, :1], v[:, :1], g=g[:, :1], beta=beta[:, :1], initial_state=h0,
                  output_final_state=True)
    assert rec.ops and not any("kda_compile" in op for op in rec.ops)
    assert any("cumsum" in op for op in rec.ops)  # HF's chunk reference ran


# ----------------------------------------------------------------------------------------------
# Gated DeltaNet (Qwen3-Next and relatives): the per-head gate broadcast over the key channels
# ----------------------------------------------------------------------------------------------
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


@pytest.mark.parametrize("name,op,T", [("torch_chunk_gated_delta_rule", "chunk_gdn_fwd", 70),
                                       ("torch_recurrent_gated_delta_rule", "fused_recurrent_gdn_fwd", 1)])
@pytest.mark.parametrize("value_heads", [2, 4])
def test_hf_gated_delta_rule_becomes_our_op(name, op, T, value_heads):
    """HF's torch reference, through HF's wrapper (whatever it bound: the torch reference, or FLA's GDN
    function, test_hf_gdn_wrapper_bound_to_fla_is_substituted), becomes the GDN op with the gate as it is."""
    fn = torch_entry(getattr(qwen3_next, name))
    if value_heads != 2 and "repeat_interleave" not in inspect.getsource(torch_reference(fn)):
        pytest.skip(f"transformers {transformers_version()}'s {name} has no grouped value heads")
    (q, k, v, g, beta), h0 = inputs(T=T, H=value_heads)
    q, k = q[:, :, :2], k[:, :, :2]  # 2 q/k heads; value head h reads q/k head h // (value_heads // 2)
    g = g[..., 0]  # one decay per value head

    def call(q, k, v, g, beta, h0, fn=fn):
        return fn(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  cu_seqlens=None)

    (o, state), cap = compile_call(call, q, k, v, g, beta, h0)
    o_ref, state_ref = call(q, k, v, g, beta, h0, fn=torch_reference(fn))
    assert kda_ops(cap) == [op]
    assert rel_error(o, o_ref) < FP32_TOL and rel_error(state, state_ref) < FP32_TOL
    (site,) = [r for r in cap.reports[-1].rewritten if r.rewrite == "kda_substitution"]
    assert "gated_delta_rule" in site.details["entry"] and site.details["heads"] == f"2/{value_heads}"


@pytest.mark.parametrize("name", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"])
def test_hf_gdn_wrapper_bound_to_fla_is_substituted(name):
    """A GDN wrapper bound to FLA's GDN function is substituted (the GDN ops choose FLA's GDN kernels
    themselves on CUDA), and so are the torch reference and FLA's function."""
    wrapper = getattr(qwen3_next, name)
    if torch_bound(wrapper):
        pytest.skip(f"HF's {name} is bound to {binding(wrapper)}: no FLA GDN function bound here")
    originals = [r.original for r in registry.registered()]
    bound = kda_substitution.hf_bound_implementation(wrapper)
    assert all(any(o is fn for o in originals) for fn in (wrapper, wrapper.__wrapped__, bound))


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def test_tiny_qwen3_next_prefill():
    import transformers

    config = transformers.Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    ids = torch.randint(3, 128, (2, 70), generator=torch.Generator().manual_seed(0))
    # HF's torch path whatever is installed (FLA's / causal-conv1d's kernels need CUDA tensors)
    with torch.no_grad(), torch_path(qwen3_next, "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                                     "causal_conv1d_fn", "causal_conv1d_update"):
        out, cap = compile_call(model.eval(), ids)
        ref = model(ids)
    assert kda_ops(cap) == ["chunk_gdn_fwd"]
    assert rel_error(out.logits, ref.logits) < FP32_TOL


# ----------------------------------------------------------------------------------------------
# Switches
# ----------------------------------------------------------------------------------------------
def test_config_off_traces_the_original_code():
    """On HF's torch path (the wrapper when it bound the reference): traced as written it runs on CPU."""
    (q, k, v, g, beta), h0 = inputs(T=5)
    fn = torch_entry(hf.recurrent_kimi_delta_attention)

    def call(q, k, v, g, beta, h0):
        return fn(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True)

    ref = call(q, k, v, g, beta, h0)
    off, on = Config(compiler="aot_eager", kda_substitution=False), QUICK
    for config, expected in ((off, []), (on, ["fused_recurrent_kda_fwd"]), (off, [])):
        (o, state), cap = compile_call(call, q, k, v, g, beta, h0, config=config)
        assert kda_ops(cap) == expected
        assert rel_error(o, ref[0]) < FP32_TOL and rel_error(state, ref[1]) < FP32_TOL
    # optimize() with the switch off: HF's loop unrolled (5 tokens), no KDA op, no KDA site reported
    compiled = optimize(call, off, fullgraph=True)
    assert rel_error(compiled(q, k, v, g, beta, h0)[0], ref[0]) < FP32_TOL
    import kda_compile

    assert not [r for r in kda_compile.report(compiled).rewritten if r.rewrite == "kda_substitution"]


@pytest.mark.parametrize("value,enabled", [("0", False), ("off", False), ("False", False), ("1", True),
                                           ("", True), ("yes", True)])
def test_environment_switch_values(monkeypatch, value, enabled):
    monkeypatch.setenv(kda_substitution.ENV_SWITCH, value)
    assert kda_substitution.substitution_enabled_by_env() is enabled


def test_environment_switch_rejects_unknown_values_loudly(monkeypatch, caplog):
    monkeypatch.setenv(kda_substitution.ENV_SWITCH, "maybe")
    with caplog.at_level(logging.WARNING, "kda_compile.passes.kda_substitution"):
        assert kda_substitution.substitution_enabled_by_env()
    assert "KDA_COMPILE_SUBSTITUTION must be one of" in caplog.text and "'maybe'" in caplog.text
