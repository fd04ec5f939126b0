"""The MLA rewrite: Hugging Face's expand-then-attend into ``kda_compile.ops.mla_attention`` (``absorb.py``).
"""
