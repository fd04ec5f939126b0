"""The environment switches (ops/envs.py): one accessor each, clear errors for bad values, every reader goes
through the module, and docs/environment.md lists exactly what the module defines."""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

from kda_compile.ops import envs

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ("ops", "passes", "kda_compile")
NAMES = {s.name for s in envs.SWITCHES}

# (switch, a raw value, what the accessor returns for it); None: unset
VALID = [
    (envs.CHECK_INPUTS, None, False), (envs.CHECK_INPUTS, "1", True), (envs.CHECK_INPUTS, " Yes ", True),
    (envs.CHECK_INPUTS, "off", False), (envs.CHECK_INPUTS, "", False),
    (envs.STRICT, None, False), (envs.STRICT, "1", True), (envs.STRICT, "0", False), (envs.STRICT, "", False),
    (envs.SUBSTITUTION, None, True), (envs.SUBSTITUTION, "0", False), (envs.SUBSTITUTION, "False", False),
    (envs.SUBSTITUTION, "yes", True), (envs.SUBSTITUTION, "", True),
    (envs.CACHE_DIR, "/tmp/kc", "/tmp/kc"), (envs.CACHE_DIR, "", None),
    (envs.PREPARE_KERNEL, None, "auto"), (envs.PREPARE_KERNEL, " Triton ", "triton"), (envs.PREPARE_KERNEL, "", "auto"),
    (envs.SCAN_KERNEL, "cuda", "cuda"),
    (envs.PREFILL_SEGMENTS, None, None), (envs.PREFILL_SEGMENTS, "", None), (envs.PREFILL_SEGMENTS, "3", 3),
    (envs.LAUNCH_PLANS, None, True), (envs.LAUNCH_PLANS, "0", False), (envs.LAUNCH_PLANS, "1", True),
    (envs.DECODE_AUTOTUNE, None, False), (envs.DECODE_AUTOTUNE, "1", True), (envs.DECODE_AUTOTUNE, "0", False),
    (envs.MLA_DECODE_KERNEL, "wgmma", "wgmma"), (envs.TOPK_KERNEL, "triton", "triton"),
    (envs.POOL_KERNEL, "cuda", "cuda"), (envs.INDEXER_KERNEL, "auto", "auto"),
    (envs.SPARSE_ATTENTION_KERNEL, "triton", "triton"),
]
# (switch, a bad value, words of the accepted values the error names)
INVALID = [
    (envs.CHECK_INPUTS, "maybe", "one of 1, true"), (envs.STRICT, "yes", "1, 0 or unset"),
    (envs.SUBSTITUTION, "maybe", "one of 0/false/off/no (off)"),
    (envs.PREPARE_KERNEL, "fast", "one of auto, triton, cuda"), (envs.SCAN_KERNEL, "fast", "one of auto, triton, cuda"),
    (envs.PREFILL_SEGMENTS, "many", "an integer"), (envs.LAUNCH_PLANS, "off", "1, 0 or unset"),
    (envs.DECODE_AUTOTUNE, "true", "1, 0 or unset"), (envs.MLA_DECODE_KERNEL, "cuda", "one of auto, triton, wgmma"),
    (envs.TOPK_KERNEL, "fast", "one of auto, triton, cuda"), (envs.POOL_KERNEL, "fast", "one of auto, triton, cuda"),
    (envs.INDEXER_KERNEL, "fast", "one of auto, triton, cuda"),
    (envs.SPARSE_ATTENTION_KERNEL, "fast", "one of auto, triton, cuda"),
]


def switch(name: str) -> envs.Switch:
    return next(s for s in envs.SWITCHES if s.name == name)


def test_every_switch_is_listed_once_with_its_description():
    assert len(NAMES) == len(envs.SWITCHES)
    for s in envs.SWITCHES:
        assert s.name.startswith("KDA_COMPILE_") and s.type in ("bool", "choice", "int", "path")
        assert s.default and s.accepted and s.meaning and callable(s.read)


@pytest.mark.parametrize("name, value, expected", VALID)
def test_accessors_read_the_environment_at_call_time(monkeypatch, name, value, expected):
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    assert switch(name).read() == expected


@pytest.mark.parametrize("name, value, accepted", INVALID)
def test_a_bad_value_names_the_variable_the_value_and_what_is_accepted(monkeypatch, name, value, accepted):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as error:
        switch(name).read()
    message = str(error.value)
    assert message.startswith(f"{name} must be ") and accepted in message and message.endswith(f", got {value!r}")


def test_every_switch_has_a_valid_and_a_bad_value_tested():
    assert {name for name, _, _ in VALID} == NAMES
    assert {name for name, _, _ in INVALID} == NAMES - {envs.CACHE_DIR}  # any folder name is accepted


def test_the_cache_dir_defaults_under_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv(envs.CACHE_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert envs.cache_dir() == str(tmp_path / "kda_compile")


def test_the_raw_reader_sees_every_change(monkeypatch):
    monkeypatch.delenv(envs.SCAN_KERNEL, raising=False)
    read = envs.raw_reader((envs.SCAN_KERNEL, envs.CHECK_INPUTS))
    assert read()[0] is None
    monkeypatch.setenv(envs.SCAN_KERNEL, "triton")
    assert read()[0] in ("triton", b"triton")


def test_the_documentation_holds_the_generated_table():
    page = (ROOT / "docs" / "environment.md").read_text()
    assert envs.markdown_table() in page, "docs/environment.md is out of date: paste envs.markdown_table()"


def _python_files():
    for folder in SOURCES:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_every_switch_named_in_the_code_or_docs_is_defined():
    texts = [p.read_text() for p in _python_files()]
    texts += [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))]
    texts += [(ROOT / name).read_text() for name in ("README.md", "CONTRIBUTING.md")]
    named = {m for text in texts for m in re.findall(r"KDA_COMPILE_[A-Z_]*[A-Z]", text)}
    assert named <= NAMES, sorted(named - NAMES)


# Reads of the environment outside ops/envs.py that are not switches read by the library: (file, why).
ALLOWED_READS = {
    "kda_compile/bench/mla.py",  # saves and restores KDA_COMPILE_MLA_DECODE_KERNEL around a forced-kernel block
    "kda_compile/bench/cp_worker.py", "kda_compile/bench/kda_providers.py",  # FLA's switch FLA_FLASH_KDA (written)
    "kda_compile/coverage/sweep.py",  # copies the environment for a subprocess
    "kda_compile/bench/cold_start.py",  # the same, with fresh cache folders
}


def _environment_reads(tree: ast.AST):
    """(line, key) of every ``os.environ.get(key)``, ``os.environ[key]``, ``os.getenv(key)`` in ``tree``."""
    def is_environ(node):
        return isinstance(node, ast.Attribute) and node.attr == "environ" and getattr(node.value, "id", "") == "os"

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute) and (
                (node.func.attr == "get" and is_environ(node.func.value))
                or (node.func.attr == "getenv" and getattr(node.func.value, "id", "") == "os")):
            yield node.lineno, node.args[0]
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            yield node.lineno, node.slice


def test_every_switch_is_read_through_ops_envs():
    """Outside ops/envs.py the library reads the environment only by literal names of other projects
    (``TRITON_INTERPRET``), never a ``KDA_COMPILE_*`` switch nor a name held in a variable."""
    stray = []
    for path in _python_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in ("ops/envs.py", *ALLOWED_READS):
            continue
        for line, key in _environment_reads(ast.parse(path.read_text())):
            literal = isinstance(key, ast.Constant) and isinstance(key.value, str)
            if not literal or key.value.startswith("KDA_COMPILE_"):
                stray.append(f"{rel}:{line}")
    assert not stray, stray
