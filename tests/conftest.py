"""Test configuration: hypothesis profiles, the CUDA marker, Triton's interpreter on CPU.

Profiles (select with HYPOTHESIS_PROFILE):
- ``ci`` (default): few examples, fits the CPU CI budget; derandomized, so a run draws the same
  examples for the same test code on every machine (CI fails only for what a change did, and a
  failure reproduces anywhere);
- ``explore``: as ``ci`` with fresh random examples each run (to look for new failures locally);
- ``thorough``: many fresh random examples (200 per test, or ``KDA_TEST_THOROUGH_EXAMPLES``: a long search
  split into runs of fewer examples, each with its own ``--hypothesis-seed``, finishes run by run inside a time
  limit), run on the GPU box.
A failure found by a random profile is pinned with ``@example`` in its test.
"""
import importlib.util
import os

import pytest
import torch
from hypothesis import HealthCheck, settings


def _interpret_triton_without_cuda() -> None:
    """Without CUDA, our Triton kernels run under the Triton interpreter (small shapes, fp32/fp16,
    one fixed launch config; compile.md: bf16 dots are unreliable there), so CI checks them too.
    Must happen before any kernel module is imported (``triton.jit`` reads the variable then);
    ``TRITON_INTERPRET=0`` in the environment opts out."""
    if "TRITON_INTERPRET" in os.environ or torch.cuda.is_available():
        return
    if importlib.util.find_spec("triton") is not None:
        os.environ["TRITON_INTERPRET"] = "1"


_interpret_triton_without_cuda()

settings.register_profile(
    "ci",
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("explore", settings.get_profile("ci"), derandomize=False)
settings.register_profile(
    "thorough",
    max_examples=int(os.environ.get("KDA_TEST_THOROUGH_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _autotune_one_config() -> None:
    """Tests check correctness, not speed: on CUDA every Triton autotuner (FLA's and ours) runs the
    first of its configs that survives the kernel's own pruning, instead of compiling and timing
    all of them. A cold FLA run otherwise
    autotunes about fifteen kernels for every new shape (minutes each), which no device budget
    affords. ``KDA_TEST_FULL_AUTOTUNE=1`` restores full autotuning."""
    if not torch.cuda.is_available() or os.environ.get("KDA_TEST_FULL_AUTOTUNE") == "1":
        return
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return
    prune = Autotuner.prune_configs  # keeps each kernel's own early pruning of invalid configs

    def first_valid_config(self, kwargs):
        return prune(self, kwargs)[:1]

    Autotuner.prune_configs = first_valid_config


_autotune_one_config()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU box)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def device(request):
    """Every device-parametrised test runs on CPU, and on CUDA too where there is one."""
    return torch.device(request.param)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and kda_compile's process-wide reports emptied before and after the test: compiled
    graphs, recompile counts and report entries of one test never reach the next."""
    from kda_compile.report import clear_reports

    torch._dynamo.reset()
    clear_reports()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session", autouse=True)
def kda_compile_process_hooks():
    """Many tests compile FLA's / HF's KDA and GDN calls with other backends (aot_eager, Inductor) and expect the
    substitutes: install the process hooks once, as the first optimize() or kda_compile backend call would
    (tests/test_process_hooks.py checks, in fresh processes, that importing kda_compile alone does not)."""
    from kda_compile import process_hooks

    process_hooks.install()
