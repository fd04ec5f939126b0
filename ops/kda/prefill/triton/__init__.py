"""The KDA / GDN prefill's Triton kernels: the prepare (``prepare.py`` with its passes ``prepare_*.py``) and the
recurrence (``scan.py``).
"""
