"""The repository's promises about itself: every package folder is installed, CI runs the README's
test command, and code never imports the top-level folder names."""
import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROOTS = {"kda_compile": "kda_compile", "ops": "kda_compile.ops", "passes": "kda_compile.passes"}


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = set()
    for folder, name in ROOTS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert found - listed == set(), f"package folders missing from pyproject's packages: {sorted(found - listed)}"
    assert listed - found == set(), f"pyproject lists packages that do not exist: {sorted(listed - found)}"


def _readme_test_command():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("Run the tests:", 1)[1]
    return re.search(r"```bash\n(.+?)\n```", section, re.S).group(1).strip()


def test_ci_runs_the_readme_test_command():
    command = _readme_test_command()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in [line.strip() for line in ci], f".ci/run does not run the README's test command {command!r}"


def test_ci_installs_cpu_torch_before_the_package():
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("torch==2.13.0") < ci.index('-e ".[test]"')


def test_no_top_level_ops_or_passes_imports():
    bad = []
    pattern = re.compile(r"^\s*(from|import)\s+(ops|passes)(\.|\s|$)", re.M)
    for path in ROOT.rglob("*.py"):
        if any(part.startswith(".") for part in path.relative_to(ROOT).parts):
            continue
        if pattern.search(path.read_text()):
            bad.append(str(path.relative_to(ROOT)))
    assert bad == [], f"import kda_compile.ops / kda_compile.passes instead of top-level names in {bad}"


def _global_reads(table, found):
    """(function name, global name) for every name a function reads from its module's globals."""
    for child in table.get_children():
        if child.get_type() == "function":
            for symbol in child.get_symbols():
                if symbol.is_global() and symbol.is_referenced():
                    found.append((child.get_name(), symbol.get_name()))
        _global_reads(child, found)
    return found


def test_functions_read_only_names_their_module_defines():
    """A name a function reads as a global exists in its module after import (or is a builtin):
    code paths no CPU test reaches (GPU-only benchmarks, rare branches) must still not die with a
    NameError, e.g. a helper imported inside one function and used in another."""
    import builtins
    import importlib
    import symtable

    missing = []
    for folder, package in ROOTS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if not (path.parent / "__init__.py").exists():
                continue  # scripts outside the packages (bench/results/*.py): never imported
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            module = importlib.import_module(".".join([package, *parts]))
            table = symtable.symtable(path.read_text(), str(path), "exec")
            for function, name in _global_reads(table, []):
                if not hasattr(module, name) and not hasattr(builtins, name):
                    missing.append(f"{path.relative_to(ROOT)}: {function}() reads undefined global {name!r}")
    assert not missing, "\n".join(missing)


def test_compile_caches_are_keyed_by_the_ops_source(monkeypatch):
    """torch.compile's caches know a custom op by its name only: importing our ops adds a digest of their
    source to torch's cache-key tag, so a graph cached with other ops code is not replayed."""
    import torch

    import kda_compile.ops  # noqa: F401  (tags on import)
    from kda_compile.ops._common import CACHE_TAG_PREFIX, ops_source_digest, tag_compile_caches

    assert CACHE_TAG_PREFIX + ops_source_digest() in torch.compiler.config.cache_key_tag.split()
    monkeypatch.setattr(torch.compiler.config, "cache_key_tag", f"user-tag {CACHE_TAG_PREFIX}0123")
    tag_compile_caches()
    assert torch.compiler.config.cache_key_tag == f"user-tag {CACHE_TAG_PREFIX}{ops_source_digest()}"


def test_the_package_imports_without_triton():
    """triton is optional (CPU wheels of torch do not bring it): importing kda_compile, its ops and its
    passes must not need it; our Triton kernels are imported where a call first needs them."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None; import kda_compile, kda_compile.ops, kda_compile.passes; "
            "print('imported')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent, timeout=300)
    assert done.stdout.strip() == "imported", done.stderr[-2000:]
