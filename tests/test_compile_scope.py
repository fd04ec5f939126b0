"""kda_compile.compile_scope: what a call of an optimize() result (or of a callable compiled with the kda_compile
backend) needs while Dynamo traces is applied when a compile starts and undone when it ends; a call that Dynamo
serves from its cache sets no Dynamo config value (each costs microseconds on a decode step's path)."""
from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils import _config_module

from kda_compile import Config, compile_scope, optimize

TRACE_TIME = ("capture_scalar_outputs", "capture_dynamic_output_shape_ops", "automatic_dynamic_shapes")
optimize_module = importlib.import_module("kda_compile.optimize")


@pytest.fixture
def seen_while_compiling(monkeypatch):
    """The trace-time Dynamo config and the phase each graph of ours saw when the backend compiled it."""
    seen = []

    def compile_eager(gm, example_inputs, compiler, patches):
        from kda_compile import cuda_graphs

        config = torch._dynamo.config
        seen.append({**{name: getattr(config, name) for name in TRACE_TIME}, "phase": cuda_graphs.current_phase()})
        return gm.forward

    monkeypatch.setattr("kda_compile.backend._compile_rewritten", compile_eager)
    torch._dynamo.reset()
    yield seen
    torch._dynamo.reset()


@pytest.fixture
def dynamo_writes(monkeypatch):
    """Every value set on torch._dynamo.config, by name."""
    writes = []
    original = _config_module.ConfigModule.__setattr__

    def spy(self, name, value):
        if self is torch._dynamo.config:
            writes.append(name)
        original(self, name, value)

    monkeypatch.setattr(_config_module.ConfigModule, "__setattr__", spy)
    return writes


def _user_config() -> dict:
    return {name: getattr(torch._dynamo.config, name) for name in TRACE_TIME}


def test_a_compile_sees_the_call_scope_and_a_cached_call_writes_no_config(seen_while_compiling, dynamo_writes):
    assert compile_scope.install(), "this torch has Dynamo's compile callbacks"
    before = _user_config()
    assert not before["capture_scalar_outputs"], "the test needs Dynamo's default"
    compiled = optimize(lambda x: torch.sin(x) * 2, Config(compiler="eager"))
    x = torch.randn(3, 4)
    compiled(x)
    assert len(seen_while_compiling) == 1
    assert seen_while_compiling[0]["capture_scalar_outputs"]
    assert seen_while_compiling[0]["capture_dynamic_output_shape_ops"]
    assert _user_config() == before, "the compile's settings were not undone"
    dynamo_writes.clear()
    for _ in range(3):
        compiled(x)
    assert len(seen_while_compiling) == 1, "a cached call compiled again"
    assert [name for name in dynamo_writes if name != "recompile_limit"] == [], dynamo_writes
    assert compile_scope.current() is None


def test_without_capture_the_compile_sees_the_users_config(seen_while_compiling):
    compiled = optimize(lambda x: torch.cos(x) + 1, Config(compiler="eager", capture_data_dependent_ops=False))
    compiled(torch.randn(5))
    assert seen_while_compiling[0]["capture_scalar_outputs"] is False


def test_the_backend_context_scopes_the_capture_for_torch_compile(seen_while_compiling):
    compiled = torch.compile(lambda x: torch.tanh(x) - 1, backend="kda_compile")
    compiled(torch.randn(6))
    assert seen_while_compiling and seen_while_compiling[0]["capture_scalar_outputs"]
    assert seen_while_compiling[0]["phase"] is None
    assert torch._dynamo.config.capture_scalar_outputs is False


def test_a_static_decode_scope_traces_with_static_shapes_and_says_decode(seen_while_compiling):
    scopes = optimize_module._scopes(Config())
    fn = torch.compile(lambda x: x * 3, backend="kda_compile")
    with compile_scope.entered(scopes[optimize_module.STATIC_DECODE]):
        fn(torch.randn(2, 1))
    assert seen_while_compiling[0]["automatic_dynamic_shapes"] is False
    assert seen_while_compiling[0]["phase"] == "decode"
    assert torch._dynamo.config.automatic_dynamic_shapes is True


def test_scopes_nest_and_unwind_on_errors():
    outer, inner = compile_scope.Scope(phase="prefill"), compile_scope.Scope(phase="decode")
    with compile_scope.entered(outer):
        with pytest.raises(RuntimeError):
            with compile_scope.entered(inner):
                assert compile_scope.current() is inner
                raise RuntimeError("inside")
        assert compile_scope.current() is outer
    assert compile_scope.current() is None


def test_per_call_mode_applies_and_undoes_around_the_block(monkeypatch):
    """Where torch has no compile callbacks the settings are made around the block instead."""
    monkeypatch.setattr(compile_scope, "PER_CALL", [True])
    scope = compile_scope.Scope((("capture_scalar_outputs", True),))
    with compile_scope.entered(scope):
        assert torch._dynamo.config.capture_scalar_outputs is True
    assert torch._dynamo.config.capture_scalar_outputs is False
