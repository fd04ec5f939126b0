"""The KDA / GDN prefill's CUDA kernels (NVRTC): the chunk plan, the prepare and the scan. Each ``*_source.py``
holds its kernel's launch layout and prepends the specialisation's ``#define``s to its ``.cu`` file; ``prepare.py``,
``scan.py`` and ``chunk_plan.py`` choose, compile and launch them.
"""
