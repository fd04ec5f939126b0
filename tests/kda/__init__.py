"""KDA op tests: against the fp64 token recurrence in ``recurrence.py`` (CPU, and CUDA where present)."""
