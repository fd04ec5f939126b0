"""Trace-time substitution of flash-linear-attention's entry points (passes/substitution/install.py,
the substitutes in passes/substitution/substitutes.py), with a fake FLA package (fake_fla_package.py).

Checked: the fake FLA is substituted when imported after kda_compile, when imported before it
(subprocess) and when HF's wrapper bound it, with positional arguments bound by FLA's own order; its
``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` (and ``*_gdn`` aliases) become the
GDN ops; a bf16 recurrent state is upcast as FLA reads it; an argument kda_compile does not take
leaves the call to FLA (a logged graph break), as does ``Config(kda_substitution=False)``; packed
documents' offsets that Kimi-Linear passes as ``cu_seq_lens_q`` reach the op through a FLA-bound wrapper; the
environment switch registers nothing.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kda_compile import Config
from kda_compile.ops import chunk_kda
from kda_compile.passes.substitution import install as kda_substitution, registry
from kda_compile.testing import rel_error

from .fake_fla_package import write_fake_fla
from .graph_capture import GraphCapture
from .kda_substitution_helpers import FP32_TOL, compile_call, hf, inputs, kda_ops


@pytest.fixture
def fake_fla(tmp_path, monkeypatch):
    """The fake ``fla`` imported after kda_compile; the real one (if any) comes back afterwards."""
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(write_fake_fla(tmp_path))
    yield importlib.import_module("fla.ops.kda")
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name, raising=False)


def fla_inputs(T=13):
    (q, k, v, g, beta), h0 = inputs(T=T)
    return q, k, v, g, beta, h0


def test_fla_imported_after_kda_compile_is_substituted(fake_fla):
    import fla.ops

    (chunk,) = [r for r in registry.registered() if r.original is fake_fla.chunk_kda]
    assert fla.ops.chunk_kda is fake_fla.chunk_kda  # aliases: one object, registered once, found at each
    assert {"fla.ops.kda.chunk.chunk_kda", "fla.ops.kda.chunk_kda", "fla.ops.chunk_kda"} <= set(chunk.found_at)
    q, k, v, g, beta, h0 = fla_inputs()
    for fn, op in ((fake_fla.chunk_kda, "chunk_kda_fwd"), (fake_fla.fused_recurrent_kda, "fused_recurrent_kda_fwd")):
        call = lambda *a, fn=fn: fn(*a[:5], initial_state=a[5], output_final_state=True,  # noqa: E731
                                    use_qk_l2norm_in_kernel=True)
        fake_fla.calls.clear()
        (o, state), cap = compile_call(call, q, k, v, g, beta, h0)
        assert fake_fla.calls == []  # the compiled call never ran FLA's function
        assert kda_ops(cap) == [op]
        o_ref, state_ref = call(q, k, v, g, beta, h0)
        assert len(fake_fla.calls) == 1  # eager runs it
        assert rel_error(o, o_ref) < FP32_TOL and rel_error(state, state_ref) < FP32_TOL


def test_fla_gated_delta_rule_becomes_the_gdn_ops(fake_fla):
    import fla.ops
    import fla.ops.gated_delta_rule as fla_gdn

    (chunk,) = [r for r in registry.registered() if r.original is fla_gdn.chunk_gated_delta_rule]
    assert {"fla.ops.gated_delta_rule.chunk_gdn", "fla.ops.chunk_gated_delta_rule"} <= set(chunk.found_at)
    assert fla.ops.chunk_gdn is fla_gdn.chunk_gated_delta_rule
    (q, k, v, g, beta), h0 = inputs(T=21, H=4)
    q, k, g = q[:, :, :2], k[:, :, :2], g[..., 0]  # grouped value heads, one decay per value head
    for fn, op in ((fla_gdn.chunk_gdn, "chunk_gdn_fwd"), (fla_gdn.fused_recurrent_gdn, "fused_recurrent_gdn_fwd")):
        call = lambda *a, fn=fn: fn(*a[:4], beta=a[4], initial_state=a[5], output_final_state=True,  # noqa: E731
                                    use_qk_l2norm_in_kernel=True)
        fla_gdn.calls.clear()
        (o, state), cap = compile_call(call, q, k, v, g, beta, h0)
        assert fla_gdn.calls == [] and kda_ops(cap) == [op]
        site = cap.reports[-1].rewritten[0]
        assert site.details["entry"] == f"fla {fn.__name__}" and site.details["heads"] == "2/4"
        o_ref, state_ref = call(q.repeat_interleave(2, 2), k.repeat_interleave(2, 2), v, g, beta, h0)
        assert rel_error(o, o_ref) < FP32_TOL and rel_error(state, state_ref) < FP32_TOL
    # gk: kda_compile's GDN does not take it; such a call is left to FLA (a logged graph break)
    torch._dynamo.reset()
    cap = GraphCapture()
    fla_gdn.calls.clear()
    torch.compile(lambda *a: fla_gdn.fused_recurrent_gdn(*a[:4], gk=a[3][..., None], beta=a[4])[0] * 2,
                  backend=cap)(q.repeat_interleave(2, 2), k.repeat_interleave(2, 2), v, g, beta)
    assert fla_gdn.calls == ["fused_recurrent_gated_delta_rule"]
    assert not any(kda_ops(cap, i) for i in range(cap.graphs))


def test_fla_positional_arguments_are_bound_by_fla_order(fake_fla):
    q, k, v, g, beta, h0 = fla_inputs(T=4)
    # FLA's fused_recurrent_kda(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state)
    call = lambda *a: fake_fla.fused_recurrent_kda(*a[:5], None, None, 0.3, a[5], True)  # noqa: E731
    (o, state), cap = compile_call(call, q, k, v, g, beta, h0)
    o_ref, state_ref = call(q, k, v, g, beta, h0)
    assert kda_ops(cap) == ["fused_recurrent_kda_fwd"]
    assert rel_error(o, o_ref) < FP32_TOL and rel_error(state, state_ref) < FP32_TOL
    assert cap.reports[-1].rewritten[0].details["scale"] == pytest.approx(0.3)


def test_fla_recurrent_bf16_state_is_upcast_as_fla_reads_it(fake_fla):
    """FLA's fused_recurrent_kda accepts a bf16 initial state (read in fp32, fp32 final state); the
    substitute hands our op its exact fp32 upcast instead of failing where eager FLA runs."""
    q, k, v, g, beta, h0 = fla_inputs(T=4)
    call = lambda *a: fake_fla.fused_recurrent_kda(*a[:5], initial_state=a[5], output_final_state=True)  # noqa: E731
    (o, state), cap = compile_call(call, q, k, v, g, beta, h0.bfloat16())
    o_ref, state_ref = call(q, k, v, g, beta, h0.bfloat16().float())
    assert kda_ops(cap) == ["fused_recurrent_kda_fwd"] and state.dtype == torch.float32
    assert rel_error(o, o_ref) < FP32_TOL and rel_error(state, state_ref) < FP32_TOL


def test_fla_argument_we_do_not_take_leaves_the_call_to_fla(fake_fla, caplog):
    q, k, v, g, beta, h0 = fla_inputs(T=6)
    at_default = lambda *a: fake_fla.chunk_kda(*a, transpose_state_layout=False)  # noqa: E731
    assert kda_ops(compile_call(at_default, q, k, v, g, beta)[1]) == ["chunk_kda_fwd"]

    other = lambda *a: fake_fla.chunk_kda(*a, transpose_state_layout=True) * 2  # noqa: E731
    with pytest.raises(Exception, match="disable"):  # the graph break FLA's own function causes
        compile_call(lambda *a: other(*a)[0], q, k, v, g, beta)
    torch._dynamo.reset()
    cap = GraphCapture()
    with caplog.at_level(logging.WARNING, "kda_compile.passes.kda_substitution"):
        fake_fla.calls.clear()
        torch.compile(lambda *a: fake_fla.chunk_kda(*a, transpose_state_layout=True)[0] * 2, backend=cap)(
            q, k, v, g, beta)
    assert fake_fla.calls == ["chunk_kda"] and not any(kda_ops(cap, i) for i in range(cap.graphs))
    assert "transpose_state_layout" in caplog.text


def test_config_off_keeps_the_fla_graph_break(fake_fla):
    q, k, v, g, beta, h0 = fla_inputs(T=6)
    call = lambda *a: fake_fla.chunk_kda(*a)[0] * 2  # noqa: E731
    with pytest.raises(Exception, match="disable"):
        compile_call(call, q, k, v, g, beta, config=Config(compiler="aot_eager", kda_substitution=False))


@pytest.fixture
def hf_with_fake_fla(fake_fla, monkeypatch):
    """Kimi-Linear's modeling module imported afresh while the fake FLA is importable: HF's
    wrappers bind FLA's functions."""
    package = importlib.import_module("transformers.models.kimi_linear")
    monkeypatch.delitem(sys.modules, hf.__name__)
    monkeypatch.setattr(package, "modeling_kimi_linear", hf)  # restored afterwards
    fresh = importlib.import_module(hf.__name__)
    monkeypatch.setitem(sys.modules, hf.__name__, hf)
    return fresh, fake_fla


def test_hf_wrapper_bound_to_fla_is_substituted(hf_with_fake_fla):
    module, fla_kda = hf_with_fake_fla
    entries = {r.entry_point for r in registry.registered()}
    assert "transformers chunk_kimi_delta_attention (HF wrapper)" in entries
    q, k, v, g, beta, h0 = fla_inputs(T=11)
    for name, op in (("chunk_kimi_delta_attention", "chunk_kda_fwd"),
                     ("recurrent_kimi_delta_attention", "fused_recurrent_kda_fwd")):
        fn = getattr(module, name)
        call = lambda *a, fn=fn: fn(*a[:3], g=a[3], beta=a[4], initial_state=a[5],  # noqa: E731
                                    output_final_state=True, use_qk_l2norm_in_kernel=True, cache_position=None)
        fla_kda.calls.clear()
        (o, state), cap = compile_call(call, q, k, v, g, beta, h0)
        assert fla_kda.calls == [] and kda_ops(cap) == [op]
        (site,) = cap.reports[-1].rewritten
        assert site.details["entry"].startswith("fla ") and site.details["entry"].endswith("via HF wrapper")
        o_ref, state_ref = call(q, k, v, g, beta, h0)
        assert fla_kda.calls == [name.split("_")[0] == "chunk" and "chunk_kda" or "fused_recurrent_kda"]
        assert rel_error(o, o_ref) < FP32_TOL and rel_error(state, state_ref) < FP32_TOL


def test_hf_wrapper_bound_to_fla_keeps_packed_documents_apart(hf_with_fake_fla):
    """Kimi-Linear passes packed documents' offsets on as ``cu_seq_lens_q``, which HF's wrapper drops before
    FLA's ``chunk_kda``: they reach the op as ``cu_seqlens`` (docs/packed-documents.md)."""
    module, fla_kda = hf_with_fake_fla
    (q, k, v, g, beta), _ = inputs(T=11, B=1, state=False)
    spans = ((0, 4), (4, 5), (5, 11))
    offsets = torch.tensor([0, 4, 5, 11, 11], dtype=torch.int32)  # an empty last document

    def call(q, k, v, g, beta, offsets):
        return module.chunk_kimi_delta_attention(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True,
                                                 cu_seq_lens_q=offsets)[0]

    fla_kda.calls.clear()
    o, cap = compile_call(call, q, k, v, g, beta, offsets)
    assert fla_kda.calls == [] and kda_ops(cap) == ["chunk_kda_fwd"]
    (site,) = cap.reports[-1].rewritten
    assert site.details["cu_seqlens"] is True
    alone = [chunk_kda(*(x[:, a:b] for x in (q, k, v, g, beta)), use_qk_l2norm_in_kernel=True)[0] for a, b in spans]
    assert rel_error(o, torch.cat(alone, 1)) < FP32_TOL


IMPORT_ORDER_SCRIPT = textwrap.dedent('''
    import json
    import torch
    import fla
    import fla.ops.kda
    import transformers.models.kimi_linear.modeling_kimi_linear as hf
    import kda_compile  # after both
    from kda_compile import process_hooks
    from kda_compile.passes.substitution import install as kda_substitution, registry

    process_hooks.install()  # what optimize() / the kda_compile backend do first (compiled here with aot_eager)
    from hf_kda_binding import binding

    q, k, v, g = (torch.randn(1, 6, 2, 8) for _ in range(4))
    g, beta = -g.abs(), torch.rand(1, 6, 2)


    def through_fla(q, k, v, g, beta):
        return fla.ops.kda.chunk_kda(q, k, v, g=g, beta=beta)[0] * 2


    def through_hf(q, k, v, g, beta):
        return hf.chunk_kimi_delta_attention(q, k, v, g=g, beta=beta)[0] * 2


    ok = {}
    for name, fn in (("fla", through_fla), ("hf", through_hf)):
        torch._dynamo.reset()  # no state left by the attempt before (a failed frame may be marked to skip)
        try:
            torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v, g, beta)
            ok[name] = True
        except Exception:
            ok[name] = False
    entries = sorted(at for r in registry.registered() for at in r.found_at)
    wrapper = hf.chunk_kimi_delta_attention
    print(json.dumps({"fla": fla.__version__, "hf_bound": binding(wrapper), "entries": entries, "one_graph": ok,
                      "hf_wrapper": f"{type(wrapper).__module__}.{type(wrapper).__qualname__} "
                                    f"{getattr(wrapper, '__module__', '?')}.{getattr(wrapper, '__qualname__', '?')}"}))
''')


@pytest.mark.parametrize("env", ["1", "0"])
def test_fla_and_hf_imported_before_kda_compile(tmp_path, env):
    """A fresh process imports the fake FLA (first on PYTHONPATH: it shadows an installed FLA)
    and HF's Kimi module (whose wrapper binds the fake) before kda_compile."""
    path = [write_fake_fla(tmp_path), os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            os.environ.get("PYTHONPATH", "")]
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join(path), KDA_COMPILE_SUBSTITUTION=env)
    done = subprocess.run([sys.executable, "-c", IMPORT_ORDER_SCRIPT], env=environ, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["fla"] == "0.0.fake" and result["hf_bound"] == "fla.ops.kda.chunk.chunk_kda", result
    if env == "1":
        assert {"fla.ops.kda.chunk_kda", "fla.ops.kda.fused_recurrent_kda",
                "transformers.models.kimi_linear.modeling_kimi_linear.chunk_kimi_delta_attention"} <= set(
                    result["entries"]), result
        assert result["one_graph"] == {"fla": True, "hf": True}, result
    else:  # nothing registered: FLA's disabled function breaks the graph, as without kda_compile.
        # HF's wrapper around it is not asserted: it broke the graph under torch 2.13 (CI) but compiled
        # into one graph under torch 2.11 + transformers 5.17 with FLA installed (H100 box, this same
        # script): HF's behaviour there, not ours.
        assert result["entries"] == [] and result["one_graph"]["fla"] is False, result
