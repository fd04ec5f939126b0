"""The KDA op's backends: the registry every backend joins (``registry.py``) and FLA's (``fla.py``, with the
Triton kernels it runs around FLA's own, ``fla_glue.py``, and our scan over FLA's intermediates, ``fla_scan.py``).
"""
