"""Delta-rule entry points recognised by computation (passes/delta_rule/probe.py).

Checked: the probe recognises transformers' own copies (Bailing-Hybrid's and GLM-5-Next's KDA
functions, Qwen3-Next's GDN function with grouped heads) against kda_reference with a relative
error < 1e-5, and refuses a copy that computes something else (beta dropped), one that raises and
one that returns the wrong dtype, each with its reason; signatures that do not read like an entry
point are not candidates. In a fixture modeling module (``transformers.models.probe_fixture``,
written here, so no list names it): a correct token-loop delta rule is traced as our op (per-channel
and per-head gates) and matches its eager run (fp32 relative error < 1e-5), the probe runs once per
function across recompiles, a wrong copy and a call with an argument the probe did not cover are
traced as written and reported with the reason, an option the function only swallows through
``**kwargs`` is ignored as the function ignores it, ``Config(kda_substitution=False)`` traces the
original. Tiny Bailing-Hybrid and GLM-5-Next models: our op at every KDA layer, the report says
"recognised by computation", zero graph breaks, logits within 1e-4 of eager.
"""
from __future__ import annotations

import sys
import textwrap
import types

import pytest
import torch
import transformers

from kda_compile import Config, optimize, report
from kda_compile.backend import KdaCompileBackend
from kda_compile.passes.delta_rule import probe as delta_rule_probe
from kda_compile.passes.substitution import install as kda_substitution, registry
from kda_compile.testing import rel_error

from .graph_capture import GraphCapture

QUICK = Config(compiler="aot_eager")
KDA_OPS = ("kda_compile::chunk_kda_fwd", "kda_compile::fused_recurrent_kda_fwd")
GDN_OPS = ("kda_compile::chunk_gdn_fwd", "kda_compile::fused_recurrent_gdn_fwd")
FIXTURE = "transformers.models.probe_fixture.modeling_probe_fixture"

FIXTURE_SOURCE = '''
import torch


def _delta_loop(q, k, v, decay, strength, state, keep_state, normalise):
    """The gated delta rule token by token; decay per key channel [B, T, H, K] or per head [B, T, H]."""
    dtype = q.dtype
    q, k, v, decay, strength = (x.float() for x in (q, k, v, decay, strength))
    if normalise:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if decay.dim() == 3:
        decay = decay[..., None]
    B, T, H, K = k.shape
    state = torch.zeros(B, H, K, v.shape[-1]) if state is None else state.float()
    outs = []
    for t in range(T):
        state = state * decay[:, t, :, :, None].exp()
        remembered = (state * k[:, t, :, :, None]).sum(-2)
        state = state + k[:, t, :, :, None] * ((v[:, t] - remembered) * strength[:, t, :, None])[:, :, None, :]
        outs.append((state * (q[:, t] * K ** -0.5)[..., None]).sum(-2))
    return torch.stack(outs, 1).to(dtype), (state if keep_state else None)


def recurrent_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False, mode="delta", **kwargs):
    return _delta_loop(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel)


def chunk_forgets_beta(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False, **kwargs):
    return _delta_loop(query, key, value, g, torch.ones_like(beta), initial_state, output_final_state,
                       use_qk_l2norm_in_kernel)


def chunk_always_raises(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False):
    raise NotImplementedError("no torch path")


def chunk_returns_fp32(query, key, value, g, beta, initial_state=None, output_final_state=False):
    o, s = recurrent_delta_rule(query, key, value, g, beta, initial_state, output_final_state)
    return o.float(), s
'''


@pytest.fixture(scope="module")
def fixture_module():
    """A modeling module no list knows, imported the way transformers' are (its functions are
    scanned when kda_compile registers entry points)."""
    module = sys.modules.get(FIXTURE)
    if module is None:
        module = types.ModuleType(FIXTURE)
        exec(compile(textwrap.dedent(FIXTURE_SOURCE), f"<{FIXTURE}>", "exec"), module.__dict__)
        sys.modules[FIXTURE] = module
        kda_substitution.register_loaded_entry_points()
    return module


def inputs(T=7, B=2, H=2, K=8, V=4, per_head=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -(0.05 + 0.5 * torch.rand(B, T, H, *(() if per_head else (K,)), generator=gen))
    beta = torch.rand(B, T, H, generator=gen)
    return q, k, v, g, beta, torch.randn(B, H, K, V, generator=gen)


def ops_in(cap: GraphCapture, names=KDA_OPS + GDN_OPS) -> list[str]:
    return [t._schema.name for snap in cap.before for t in snap.targets
            if getattr(t, "_schema", None) is not None and t._schema.name in names]


def spec_of(module_name: str, name: str):
    module = sys.modules[module_name] if module_name in sys.modules else __import__(module_name, fromlist=["_"])
    fn = getattr(module, name)
    fn = getattr(fn, "__wrapped__", fn)
    return fn, delta_rule_probe.candidate_spec(fn, f"{module_name}.{name}")


# ----------------------------------------------------------------------------------------------
# The probe
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family, name", [
    ("bailing_hybrid", "chunk_kimi_delta_attention"), ("bailing_hybrid", "recurrent_kimi_delta_attention"),
    ("glm5_next", "chunk_kimi_delta_attention"), ("glm5_next", "recurrent_kimi_delta_attention")])
def test_probe_recognises_transformers_kda_copies(family, name):
    fn, spec = spec_of(f"transformers.models.{family}.modeling_{family}", name)
    assert spec is not None and spec.chunk == name.startswith("chunk")
    verdict = delta_rule_probe.probe(fn, spec)
    assert verdict.kda and not verdict.gdn, verdict.reason
    assert verdict.error < 1e-5
    assert "recognised by computation (KDA" in verdict.describe()


def test_probe_recognises_a_gdn_function_with_grouped_heads():
    fn, spec = spec_of("transformers.models.qwen3_next.modeling_qwen3_next", "torch_chunk_gated_delta_rule")
    verdict = delta_rule_probe.probe(fn, spec)
    assert verdict.gdn and verdict.grouped and not verdict.kda
    assert verdict.error < 1e-5


@pytest.mark.parametrize("name, reason", [("chunk_forgets_beta", "relative error"),
                                          ("chunk_always_raises", "raised NotImplementedError"),
                                          ("chunk_returns_fp32", "torch.float32, expected")])
def test_probe_refuses_other_computations_with_the_reason(fixture_module, name, reason):
    fn, spec = spec_of(FIXTURE, name)
    verdict = delta_rule_probe.probe(fn, spec)
    assert not verdict.matches
    assert reason in verdict.reason and "does not compute the delta rule" in verdict.describe()


def _no_state(query, key, value, g, beta):
    pass


def _required_extra(query, key, value, g, beta, initial_state, output_final_state, cache):
    pass


def _tensor_default(query, key, value, g, beta, initial_state=None, output_final_state=False, bias=torch.zeros(1)):
    pass


def _other_order(key, query, value, g, beta, initial_state=None, output_final_state=False):
    pass


@pytest.mark.parametrize("fn", [_no_state, _required_extra, _tensor_default, _other_order, len])
def test_signatures_that_are_not_entry_points(fn):
    assert delta_rule_probe.candidate_spec(fn, "x") is None


# ----------------------------------------------------------------------------------------------
# Under torch.compile, in a module no list names
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("per_head", [False, True])
def test_recognised_function_is_traced_as_our_op(fixture_module, per_head):
    q, k, v, g, beta, h0 = inputs(per_head=per_head)

    def layer(q, k, v, g, beta, h0):
        return fixture_module.recurrent_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)

    cap = GraphCapture()
    o, state = torch.compile(layer, backend=cap, fullgraph=True)(q, k, v, g, beta, h0)
    want_o, want_state = layer(q, k, v, g, beta, h0)
    assert len(ops_in(cap)) == 1 and cap.graphs == 1
    assert rel_error(o, want_o) < 1e-5 and rel_error(state, want_state) < 1e-5
    sites = [r for rep in cap.reports for r in rep.rewritten if r.rewrite == "kda_substitution"]
    # the entry names the fixture's function (with any other matching function imported earlier in the process,
    # e.g. HF's KDA copies, when the caller's file does not say which one: "... or ...")
    entry = sites[0].details["entry"]
    assert len(sites) == 1 and "recognised by computation" in entry and "recurrent_delta_rule" in entry, entry


def test_probe_runs_once_per_function(fixture_module, monkeypatch):
    where = f"{FIXTURE}.recurrent_delta_rule"
    monkeypatch.delitem(delta_rule_probe._verdicts, where, raising=False)
    calls = []
    real = delta_rule_probe.probe
    monkeypatch.setattr(delta_rule_probe, "probe", lambda fn, spec: calls.append(spec.where) or real(fn, spec))
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: fixture_module.recurrent_delta_rule(*a, output_final_state=True),
                             backend=GraphCapture())
    for T in (3, 5, 6):  # a static graph, then a dynamic one, then reused
        compiled(*inputs(T=T)[:5])
    assert calls == [where]


def test_wrong_copy_is_traced_as_written_and_reported(fixture_module):
    q, k, v, g, beta, h0 = inputs(T=4)

    def layer(q, k, v, g, beta):
        return fixture_module.chunk_forgets_beta(q, k, v, g, beta, output_final_state=True)

    cap = GraphCapture()
    o, _ = torch.compile(layer, backend=cap, fullgraph=True)(q, k, v, g, beta)
    assert ops_in(cap) == []
    assert rel_error(o, layer(q, k, v, g, beta)[0]) < 1e-6
    reasons = [c.reason for rep in cap.reports for c in rep.left_alone if c.rewrite == "kda_substitution"]
    assert len(reasons) == 1 and "chunk_forgets_beta does not compute the delta rule" in reasons[0], reasons


def test_argument_the_probe_did_not_cover_is_traced_as_written(fixture_module, caplog):
    q, k, v, g, beta, h0 = inputs(T=4)

    def layer(q, k, v, g, beta):
        return fixture_module.recurrent_delta_rule(q, k, v, g, beta, mode="other")

    cap = GraphCapture()
    with caplog.at_level("WARNING", logger="kda_compile.passes.delta_rule_probe"):
        o, _ = torch.compile(layer, backend=cap, fullgraph=True)(q, k, v, g, beta)
    assert ops_in(cap) == []
    assert rel_error(o, layer(q, k, v, g, beta)[0]) < 1e-6
    assert "argument(s) mode the probe did not cover" in caplog.text
    reasons = [c.reason for rep in cap.reports for c in rep.left_alone]
    assert any("recurrent_delta_rule traced as written" in r and "mode the probe did not cover" in r for r in reasons)


def test_config_off_traces_the_original(fixture_module):
    q, k, v, g, beta, h0 = inputs(T=4)

    def layer(q, k, v, g, beta):
        return fixture_module.recurrent_delta_rule(q, k, v, g, beta)

    backend = KdaCompileBackend(Config(compiler="aot_eager", kda_substitution=False))
    o, _ = torch.compile(layer, backend=backend, fullgraph=True)(q, k, v, g, beta)
    assert not any(r.rewrite == "kda_substitution" for rep in backend.reports for r in rep.rewritten)
    assert rel_error(o, layer(q, k, v, g, beta)[0]) < 1e-6


# ----------------------------------------------------------------------------------------------
# Hugging Face families that carry their own copy of Kimi's functions
# ----------------------------------------------------------------------------------------------
HF_KERNEL_NAMES = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
                   "causal_conv1d_update")


def _bailing_hybrid():
    from kda_compile.coverage.models import build_model

    return build_model("bailing_hybrid"), 2  # tiny: KDA, KDA, MLA layers


def _glm5_next():
    from kda_compile.coverage.models import shrink

    d = shrink(transformers.Glm5NextConfig().to_dict())
    d["text_config"].update(num_hidden_layers=1, layer_types=["linear_attention"], mlp_layer_types=["dense"])
    for key in ("transformers_version", "architectures", "_name_or_path"):
        d.pop(key, None)
    torch.manual_seed(0)
    cfg = transformers.Glm5NextConfig.from_dict(d)
    model = transformers.Glm5NextForConditionalGeneration._from_config(cfg, attn_implementation="eager")
    return model.eval(), 1


@pytest.mark.parametrize("make", [_bailing_hybrid, _glm5_next], ids=["bailing_hybrid", "glm5_next"])
def test_families_with_their_own_kda_copy(make):
    model, kda_layers = make()
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    modeling = sys.modules[type(model).__module__]
    # HF's torch path even where fla / causal-conv1d are installed (their kernels need CUDA tensors)
    with torch.no_grad(), kda_substitution.hf_torch_path(modeling, *HF_KERNEL_NAMES):
        want = model(input_ids=ids, use_cache=False).logits
        got = optimize(model, QUICK)(input_ids=ids, use_cache=False).logits
    assert rel_error(got, want) < 1e-4
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    sites = [r for r in report(model).rewritten if r.rewrite == "kda_substitution"]
    assert len(sites) == kda_layers, str(report(model))
    assert all("chunk_kimi_delta_attention: recognised by computation (KDA" in s.details["entry"] for s in sites)
    assert not [c for c in report(model).left_alone if c.rewrite == "kda_substitution"]


def test_an_option_the_function_does_not_take_is_ignored_as_the_function_ignores_it(fixture_module):
    q, k, v, g, beta, h0 = inputs(T=4)

    def layer(q, k, v, g, beta):  # recurrent_delta_rule has no scale parameter: **kwargs swallows it
        return fixture_module.recurrent_delta_rule(q, k, v, g, beta, scale=3.0, chunk_size=5)

    cap = GraphCapture()
    o, _ = torch.compile(layer, backend=cap, fullgraph=True)(q, k, v, g, beta)
    assert len(ops_in(cap)) == 1
    assert rel_error(o, layer(q, k, v, g, beta)[0]) < 1e-5
