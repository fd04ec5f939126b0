"""The KDA / GDN prefill's CUDA kernels (NVRTC): the chunk plan, the prepare and the scan, one ``.cu`` file each.
Each ``*_source.py`` holds its kernel's layout constants and prepends the specialisation's ``#define``s to its ``.cu``
file; ``launch.py`` describes each kernel's launch (grid, block, shared memory, parameters); ``prepare.py``,
``scan.py`` and ``chunk_plan.py`` choose, compile and launch them (``choice.py``: what their choices share).
"""
