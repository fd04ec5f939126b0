"""Test configuration: hypothesis profiles and the CUDA marker.

Profiles (select with HYPOTHESIS_PROFILE):
- ``ci`` (default): few examples, fits the CPU CI budget;
- ``thorough``: many examples, run on the GPU box.
"""
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=12,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=200,
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
