"""The delta-rule core that KDA (``kda_compile.ops.kda``) and the gated delta rule (``kda_compile.ops.gdn``) share:
one recurrence ``S = decay(g_t) S + k_t (beta_t (v_t - S^T k_t))^T``, ``o_t = S^T (scale q_t)``, whose gate's form
is the parameter: KDA's decays every key channel on its own (``g`` ``[B, T, HV, K]``), GDN's the whole state
by one scalar per value head (``g`` ``[B, T, HV]``).

What lives here is what the two ops share to the letter: the argument checks (``validation.py``), the reference
math around each op's chunked core (``reference.py``), the options and backend scaffolding (``backends.py``), the
custom-op glue (``custom_ops.py``) and the public functions' common path (``api.py``). Each op keeps its own
gate math, kernels, backends and public signatures in its folder (docs/gdn.md, section 2).
"""
