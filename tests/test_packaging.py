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
