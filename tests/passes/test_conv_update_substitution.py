"""passes/substitution/conv_update.py: HF's ``causal_conv1d_update`` (the decode step's short convolution) traced as
kda_compile.ops.causal_conv1d_update under optimize(), the conv state rolled in place by the op; greedy tokens and
the caches' conv states equal eager's; Config(kda_substitution=False) and training keep HF's code."""
import pytest
import torch

pytest.importorskip("transformers")

import kda_compile  # noqa: E402
from kda_compile.ops.conv1d import custom_ops  # noqa: E402
from kda_compile.passes.substitution import conv_update  # noqa: E402

from .families import build_qwen3_next  # noqa: E402


@pytest.fixture
def conv_calls(monkeypatch):
    calls = []
    reference = custom_ops._KERNELS["reference"]
    monkeypatch.setitem(custom_ops._KERNELS, "reference", lambda *a: calls.append(tuple(a[0].shape)) or reference(*a))
    return calls


def _decode(forward, model, ids, steps):
    """Greedy tokens of ``steps`` single-token forwards after a prefill of ``ids``, and the cache."""
    out = forward(input_ids=ids, use_cache=True)
    cache, token, tokens = out.past_key_values, out.logits[:, -1:].argmax(-1), []
    for _ in range(steps):
        out = forward(input_ids=token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        tokens.append(token)
    return torch.cat(tokens, 1), cache


def _conv_states(cache):
    return [layer.conv_states[0] for layer in cache.layers if getattr(layer, "conv_states", None)]


def test_decode_steps_run_the_op_with_eager_tokens_and_states(conv_calls):
    model = build_qwen3_next()
    ids = torch.randint(0, 128, (2, 6))
    with torch.no_grad():
        want, want_cache = _decode(model, model, ids, 3)
        compiled = kda_compile.optimize(model.forward, kda_compile.Config(compiler="aot_eager"))
        got, got_cache = _decode(compiled, model, ids, 3)
    assert torch.equal(got, want)
    channels = 2 * 2 * 16 + 4 * 16  # q and k of the key heads, v of the value heads
    assert conv_calls and set(conv_calls) == {(2, channels, 1)}  # decode only (the prefill runs causal_conv1d_fn)
    states = _conv_states(got_cache)
    assert states and all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(states, _conv_states(want_cache)))


def test_the_report_names_the_conv_update(conv_calls):
    model = build_qwen3_next()
    compiled = kda_compile.optimize(model.forward, kda_compile.Config(compiler="aot_eager"))
    with torch.no_grad():
        _decode(compiled, model, torch.randint(0, 128, (1, 5)), 1)
    details = [s.details for g in kda_compile.report(compiled).graphs for s in g.rewritten
               if s.site == "model.layers.0.linear_attn"]
    conv = [d for d in details if d.get("entry") == conv_update.ENTRY_POINT]
    assert conv == [{"entry": "transformers causal_conv1d_update", "channels": 128, "kernel_size": 4,
                     "state_len": 4, "dtype": "torch.float32"}]


def test_substitution_off_keeps_hf_code(conv_calls):
    model = build_qwen3_next()
    off = kda_compile.optimize(model.forward, kda_compile.Config(compiler="aot_eager", kda_substitution=False))
    with torch.no_grad():
        _decode(off, model, torch.randint(0, 128, (1, 5)), 1)
    assert conv_calls == []


def test_a_call_the_op_does_not_compute_is_declined_with_its_reason():
    x, state, weight = torch.randn(1, 4, 1), torch.randn(1, 4, 4), torch.randn(4, 4)
    assert conv_update.why_not_substituted(x, state, weight, None, "silu") is None
    assert "activation='gelu'" in conv_update.why_not_substituted(x, state, weight, None, "gelu")
    assert "2 entries for 4 taps" in conv_update.why_not_substituted(x, state[..., :2], weight, None, None)
    trained = weight.clone().requires_grad_()
    assert "gradients are needed" in conv_update.why_not_substituted(x, state, trained, None, "silu")
    with torch.no_grad():
        assert conv_update.why_not_substituted(x, state, trained, None, "silu") is None
