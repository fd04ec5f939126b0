"""Every public function and class of the package carries type hints on all its parameters and its
return value (the API a user reads in an IDE), and every name a public ``__all__`` lists exists."""
import importlib
import inspect

import pytest

pytest.importorskip("hypothesis", reason="kda_compile.testing needs hypothesis (the 'testing' extra)")

# import_module: ``kda_compile.ops.attention`` as an attribute is the function, not its package
MODULES = [importlib.import_module(name) for name in (
    "kda_compile", "kda_compile.ops", "kda_compile.ops.attention", "kda_compile.ops.mla", "kda_compile.ops.moe", "kda_compile.ops.dsa",
    "kda_compile.ops.gdn", "kda_compile.testing")]


def _public_callables():
    for module in MODULES:
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj):
                continue
            if inspect.isclass(obj):
                yield f"{module.__name__}.{name}", obj.__init__, True
            elif callable(obj):
                yield f"{module.__name__}.{name}", inspect.unwrap(obj), False


def _missing_hints(fn, is_init: bool) -> list[str]:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    missing = [p.name for p in signature.parameters.values()
               if p.name not in ("self", "draw") and p.annotation is inspect.Parameter.empty]
    if not is_init and signature.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_all_names_exist(module):
    assert [n for n in module.__all__ if not hasattr(module, n)] == []


def test_public_api_is_fully_annotated():
    problems = {}
    for qualname, fn, is_init in _public_callables():
        if is_init and not inspect.isfunction(fn):  # inherited from a builtin (object, dict)
            continue
        missing = _missing_hints(fn, is_init)
        if missing:
            problems[qualname] = missing
    assert problems == {}, f"public functions without type hints (parameter names): {problems}"
