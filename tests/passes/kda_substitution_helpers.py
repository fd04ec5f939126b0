"""What the KDA substitution tests share (test_kda_substitution.py, test_kda_substitution_fla.py,
test_kda_sites.py): HF's Kimi-Linear module, inputs in HF's layout, a compile through GraphCapture,
the KDA ops a graph holds and the report's KDA sites."""
from __future__ import annotations

import pytest
import torch

from kda_compile import Config
from hf_kda_binding import FLA_NAMES, torch_bound

from .graph_capture import GraphCapture

hf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

FP32_TOL, BF16_TOL = 1e-5, 1e-2
KDA_OPS = ("kda_compile::chunk_kda_fwd", "kda_compile::fused_recurrent_kda_fwd", "kda_compile::chunk_gdn_fwd",
           "kda_compile::fused_recurrent_gdn_fwd")
QUICK = Config(compiler="aot_eager")


def kda_ops(cap: GraphCapture, graph: int = -1, which: str = "before") -> list[str]:
    """Names of the KDA ops Dynamo put in a graph."""
    found = []
    for target in getattr(cap, which)[graph].targets:
        schema = getattr(target, "_schema", None)
        if schema is not None and schema.name in KDA_OPS:
            found.append(schema.name.split("::")[1])
    return found


def inputs(T=37, B=2, H=2, K=16, V=8, dtype=torch.float32, state=True, seed=0):
    """HF's layout: q/k [B, T, H, K], v [B, T, H, V], g <= 0 [B, T, H, K], beta in (0, 1) [B, T, H]."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, K, generator=gen) * 0.5
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen) * 0.1 if state else None
    return [x.to(dtype) for x in (q, k, v, g, beta)], h0


def compile_call(fn, *args, config=QUICK, **kwargs):
    cap = GraphCapture(config=config)
    out = torch.compile(fn, backend=cap, fullgraph=True)(*args, **kwargs)
    return out, cap


def wrapper_entry(name: str) -> str:
    """The report's entry for a call of HF's Kimi wrapper ``name``: what the wrapper bound."""
    wrapper = getattr(hf, name)
    bound = f"transformers {name}" if torch_bound(wrapper) else f"fla {FLA_NAMES[name]}"
    return f"{bound} via HF wrapper"


def kda_sites(cap: GraphCapture) -> list:
    return [r for r in cap.reports[-1].rewritten if r.rewrite == "kda_substitution"]
