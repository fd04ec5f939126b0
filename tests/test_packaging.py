"""The repository's promises about itself: every package folder is installed, the wheel holds Python
modules and metadata only, CI installs what the README's set-up installs and runs its test command, the
extras the README and the error messages name exist, optional dependencies stay optional, and code never
imports the top-level folder names."""
import pathlib
import re
import subprocess
import sys
import tomllib
import zipfile

from packaging.requirements import Requirement

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


def test_the_package_imports_without_triton(tmp_path):
    """triton is optional (CPU wheels of torch do not bring it): importing kda_compile, its ops and its
    passes must not need it; our Triton kernels are imported where a call first needs them. Run from an empty
    folder: a clone's parent folder would hold the clone itself, which shadows the package when the clone is
    named kda_compile."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None; import kda_compile, kda_compile.ops, kda_compile.passes; "
            "print('imported')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.stdout.strip() == "imported", done.stderr[-2000:]


def _readme_setup_command():
    """The README's set-up command: its first bash block that installs the package."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.+?)\n```", readme, re.S)
    setup = [block.strip() for block in blocks if "pip install -e" in block]
    assert setup, "the README has no set-up command (a bash block with `pip install -e`)"
    return setup[0]


def test_ci_installs_what_the_readme_setup_installs():
    """Every `pip install ...` of the README's set-up command, in order, is an install line of .ci/run
    (which may add pip options such as --quiet), and .ci/run runs the set-up's example too."""
    steps = [step.strip() for step in _readme_setup_command().split("&&")]
    installs = [step.split("pip install", 1)[1].split() for step in steps if step.startswith("pip install")]
    assert installs[0] == ["torch==2.13.0"], f"the README's set-up must install torch==2.13.0 first, not {installs[0]}"
    ci_installs = [line.split("pip install", 1)[1].split() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                   if re.match(r"\s*(python3 -m )?pip install", line)]
    ci_installs = [[arg for arg in args if not arg.startswith("--")] for args in ci_installs]
    assert ci_installs == installs, f".ci/run installs {ci_installs}, the README's set-up {installs}"
    ci = (ROOT / ".ci" / "run").read_text()
    for step in steps:
        if step.startswith("python "):
            script = step.split()[1]
            assert (ROOT / script).is_file(), f"the README's set-up runs {script}, which does not exist"
            assert f"python3 {script}" in ci, f".ci/run does not run the set-up's {script}"


def _extras():
    return _pyproject()["project"]["optional-dependencies"]


def test_the_extras_that_the_docs_and_messages_name_exist():
    """`.[test]`, `kda-compile[testing]`, ... wherever the README, the docs, .ci/run or an error message of the
    package names an extra, pyproject defines it."""
    pattern = re.compile(r"(?:\.|kda-compile|kda_compile)\[([A-Za-z0-9_,\- ]+)\]")
    files = [ROOT / "README.md", ROOT / ".ci" / "run", *ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md")]
    for folder in ROOTS:
        files += (ROOT / folder).rglob("*.py")
    named = {}
    for path in files:
        if path.is_file():
            for match in pattern.finditer(path.read_text()):
                for extra in match.group(1).split(","):
                    named.setdefault(extra.strip(), set()).add(str(path.relative_to(ROOT)))
    unknown = {extra: sorted(paths) for extra, paths in named.items() if extra not in _extras()}
    assert unknown == {}, f"extras named but not defined in pyproject.toml: {unknown}"
    setup_extras = re.findall(r"\.\[([^\]]+)\]", _readme_setup_command())
    assert setup_extras == ["test"], f"the README's set-up installs the extras {setup_extras}, expected ['test']"


def test_the_test_extra_holds_everything_the_suite_needs():
    """`test` holds the requirements of `hf` and `testing` (same specs), pytest, xdist and triton for the
    interpreter; no extra pins torch (installed first, by hand: CPU or CUDA wheel)."""
    extras = {name: [Requirement(r) for r in reqs] for name, reqs in _extras().items()}
    assert {"hf", "testing", "fla", "bench", "test"} <= set(extras)
    test = {str(r) for r in extras["test"]}
    for name in ("hf", "testing"):
        missing = {str(r) for r in extras[name]} - test
        assert not missing, f"the test extra lacks {name}'s {sorted(missing)}"
    names = {r.name for r in extras["test"]}
    assert {"pytest", "pytest-xdist", "hypothesis", "transformers", "triton"} <= names
    for name, reqs in extras.items():
        assert "torch" not in {r.name for r in reqs}, f"the {name} extra must not pull torch"


def test_the_license_metadata_is_consistent():
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def _source_tree_copy(dest):
    """The files a wheel is built from, without __pycache__ (and whatever else git would not track is
    still copied inside the package folders: the wheel must leave it out)."""
    import shutil

    dest.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, dest / name)
    for folder in ROOTS:
        shutil.copytree(ROOT / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return dest


def test_the_wheel_holds_python_modules_cuda_sources_and_metadata_only(tmp_path):
    """Builds the wheel (offline, no isolation: torch brings setuptools >= 77) from a copy of the tree and
    checks it holds every module and every CUDA source (*.cu / *.cuh) of the listed packages, installed under
    kda_compile/, the py.typed marker, the license and the metadata, and nothing else (no benchmark results,
    CSVs, PNGs, logs, notes)."""
    src = _source_tree_copy(tmp_path / "src")
    (src / "kda_compile" / "stray_results").mkdir()
    (src / "kda_compile" / "stray_results" / "table.csv").write_text("a,b\n")  # package data never ships
    (src / "ops" / "notes.md").write_text("# notes\n")
    out = tmp_path / "wheel"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(out), str(src)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = out.glob("kda_compile-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = {n for n in names if n.split("/", 1)[0].endswith(".dist-info")}
    modules = set(names) - dist_info
    assert "kda_compile/py.typed" in modules, "the PEP 561 marker is missing: type checkers would ignore our hints"
    modules.discard("kda_compile/py.typed")
    shipped = (".py", ".cu", ".cuh")
    assert {n for n in modules if not (n.startswith("kda_compile/") and n.endswith(shipped))} == set(), \
        f"the wheel holds files other than kda_compile's modules and CUDA sources: {sorted(modules)}"
    package_dir = _pyproject()["tool"]["setuptools"]["package-dir"]
    expected = set()
    for package in _pyproject()["tool"]["setuptools"]["packages"]:
        base = max((p for p in package_dir if package == p or package.startswith(p + ".")), key=len)
        folder = src.joinpath(package_dir[base], *package[len(base):].split(".")[1:])
        # CUDA sources sit beside the modules of their package (setuptools' package-data globs one folder)
        expected |= {"/".join([*package.split("."), path.name])
                     for pattern in ("*.py", "*.cu", "*.cuh") for path in folder.glob(pattern)}
    assert modules == expected, (f"missing from the wheel: {sorted(expected - modules)}; "
                                 f"unexpected: {sorted(modules - expected)}")
    info = {n.split("/", 1)[1] for n in dist_info}
    assert info == {"METADATA", "WHEEL", "RECORD", "entry_points.txt", "top_level.txt", "licenses/LICENSE"}, info
    metadata = zipfile.ZipFile(wheel).read(next(n for n in dist_info if n.endswith("/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    for extra in _extras():
        assert f"Provides-Extra: {extra}" in metadata


def test_optional_dependencies_stay_optional(tmp_path):
    """A plain import of the package, its ops, passes and kda_compile.optimize loads none of hypothesis,
    transformers, matplotlib, fla-core (the HF rewrites and the benchmarks import transformers where a call
    meets a Hugging Face model); without them every module imports, and kda_compile.testing fails with an
    ImportError that names hypothesis and the extra that brings it."""
    code = """
import importlib, pkgutil, sys
OPTIONAL = ("hypothesis", "transformers", "matplotlib", "fla")
import kda_compile, kda_compile.ops, kda_compile.passes, kda_compile.optimize
print(sorted(name for name in OPTIONAL if name in sys.modules))
for name in OPTIONAL:
    sys.modules[name] = None
for module in pkgutil.walk_packages(kda_compile.__path__, "kda_compile."):
    if not module.name.startswith("kda_compile.testing"):
        importlib.import_module(module.name)
try:
    import kda_compile.testing
except ImportError as exc:
    print("ImportError:", exc)
else:
    print("imported kda_compile.testing without hypothesis")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded, message = done.stdout.strip().splitlines()[-2:]
    assert loaded == "[]", f"importing kda_compile loads optional dependencies: {loaded}"
    assert message.startswith("ImportError:") and "hypothesis" in message, message
    assert 'pip install "kda-compile[testing]"' in message, message


def test_every_cited_design_note_exists():
    """Code and docs cite design notes as ``docs/<name>.md`` (and notes link each other): each must exist."""
    cited = re.compile(r"\bdocs/([\w.-]+\.md)")
    missing = []
    sources = [p for p in ROOT.rglob("*.py") if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
    sources += [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "README.md",
                *(ROOT / "docs").glob("*.md")]
    for path in sources:
        for name in cited.findall(path.read_text()):
            if not (ROOT / "docs" / name).is_file():
                missing.append(f"{path.relative_to(ROOT)} cites docs/{name}")
    assert missing == [], f"citations of design notes that do not exist: {missing}"
