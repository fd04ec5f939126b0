"""GDN's decode step on KDA's fused Triton kernel (``kernel.py``) and its backend (``backend.py``).
"""
