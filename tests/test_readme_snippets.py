"""The README's code blocks that say they run as written do run: the ops block, executed on a CPU."""
from __future__ import annotations

import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_block_after(heading: str) -> str:
    text = README.read_text()
    start = text.index(heading)
    match = re.search(r"```python\n(.*?)```", text[start:], re.DOTALL)
    assert match, f"no python block after {heading!r} in README.md"
    return match.group(1)


def test_the_ops_block_runs_as_written():
    code = python_block_after("### The ops")
    assert "this runs on a CPU as written" in code
    scope: dict = {}
    exec(compile(code, "README.md (The ops)", "exec"), scope)  # noqa: S102  (our own README)
    for name, shape in (("o1", (2, 1, 4, 32)), ("out", (1, 8, 128, 64)), ("idx", (1, 16, 32)),
                        ("state", (1, 4, 32, 32))):
        assert tuple(scope[name].shape) == shape, (name, tuple(scope[name].shape))
    assert all(torch.isfinite(scope[n]).all() for n in ("o1", "out", "lse"))
