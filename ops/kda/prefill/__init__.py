"""KDA's chunked prefill: the segment and kernel cost model (``plan.py``), the run of a whole prefill
(``run.py``), the host fast path (``fast_path.py``), the chunk counting (``chunks.py``) and the backend
(``backend.py``); the CUDA kernels under ``cuda/``, their Triton twins under ``triton/``.
"""
