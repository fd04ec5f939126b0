"""How many examples a drawn test asks for: its own count under the ``ci`` and ``explore`` profiles (the CPU
CI budget), and at least the profile's count under ``thorough`` (the GPU box), so an explicit
``max_examples`` on a slow test does not cap a thorough run."""
import os

from hypothesis import settings


def draws(n: int) -> int:
    if os.environ.get("HYPOTHESIS_PROFILE") == "thorough":
        return max(n, settings.get_profile("thorough").max_examples)
    return n
