"""Softmax attention rewrites: Hugging Face's eager attention (``softmax.py``) and torch's SDPA calls
(``sdpa.py``) into ``kda_compile.ops.attention``; what the eager mask means (``mask.py``), N-D attention
folded into 4-D (``fold.py``), exact normalisations and batched 3-D spellings that bring more models to the
matched form (``normalize.py``, ``spellings.py``), and the ``exp(x - logsumexp(x))`` softmax reported
(``lse_softmax.py``).
"""
