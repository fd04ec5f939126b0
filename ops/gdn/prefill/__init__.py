"""GDN's chunked prefill on KDA's kernels with the scalar gate (``run.py``) and its backend (``backend.py``).
"""
