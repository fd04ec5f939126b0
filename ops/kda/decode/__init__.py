"""KDA's decode step: the fused Triton kernel (``kernel.py``) and its backend (``backend.py``).
"""
