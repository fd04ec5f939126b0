"""The GDN op's backends: the registry (``registry.py``), FLA's (``fla.py``), the route through KDA's kernels
(``kda.py``) and what our own kernels' backends share (``own_kernels.py``).
"""
