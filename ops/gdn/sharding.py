"""DTensor placements of the GDN ops: KDA's (``kda_compile.ops.kda.sharding``), whose argument names and
head layout they share; g ``[B, T, HV]`` and dt_bias ``[HV]`` carry their heads on the same dims as KDA's
``[B, T, HV, K]`` and ``[HV * K]``. Grouped value heads (``HV % H == 0``) are sharded together with their
q / k heads. docs/distributed.md has the table."""
from __future__ import annotations

from kda_compile.ops.kda.sharding import delta_rule_rules

RULES = delta_rule_rules("chunk_gdn", "fused_recurrent_gdn")
