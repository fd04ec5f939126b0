"""Gated delta rule (GDN): FLA-compatible public functions over ``torch.ops.kda_compile.*_gdn_*`` ops
(docs/gdn.md)."""
from kda_compile.ops.gdn.api import (chunk_gated_delta_rule, chunk_gdn, fused_recurrent_gated_delta_rule,
                                     fused_recurrent_gdn)

__all__ = ["chunk_gated_delta_rule", "chunk_gdn", "fused_recurrent_gated_delta_rule", "fused_recurrent_gdn"]
