"""Delta-rule (KDA and GDN) rewrites: an unrolled token-by-token recurrence collapsed into one op call
(``recurrence.py``, with the one-token pattern in ``step.py``), the gate / beta / q-k norm prologue folded
into the op (``prologue.py``), and look-alike delta-rule functions of transformers recognised by what they
compute (``probe.py``, a trace-time substitution).
"""
