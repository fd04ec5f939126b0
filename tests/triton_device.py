"""Where the tests of our Triton kernels run: on CUDA, or on CPU under the Triton interpreter
(tests/conftest.py switches the interpreter on where there is no CUDA, before any test module loads)."""
import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_device(what: str) -> torch.device:
    """The device the calling test module's kernels run on; skips the module (naming ``what``) when triton
    is missing or there is neither CUDA nor the interpreter. Call it before importing kernel modules."""
    pytest.importorskip("triton")
    if not (torch.cuda.is_available() or INTERPRETED):
        pytest.skip(f"{what} need CUDA or TRITON_INTERPRET=1", allow_module_level=True)
    return torch.device("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu")
