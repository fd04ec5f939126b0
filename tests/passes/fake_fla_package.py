"""A fake flash-linear-attention package for the substitution tests (test_kda_substitution_fla.py):
entry points wrapped in ``torch.compiler.disable`` as FLA's are, eager math by a float64 token loop,
each call recorded in the module's ``calls``. ``fla.ops.kda`` has ``chunk_kda`` / ``fused_recurrent_kda``;
``fla.ops.gated_delta_rule`` has ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` and
their ``*_gdn`` aliases."""
from __future__ import annotations

import os

FAKE_FLA_KDA = '''
import torch

calls = []


def _naive(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    """The KDA recurrence token by token in float64 (what FLA computes)."""
    dtype = q.dtype
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.double()
    q = q * (K ** -0.5 if scale is None else scale)
    out = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(out, 1).to(dtype), (S.float() if output_final_state else None)


@torch.compiler.disable
def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, cu_seqlens=None,
              transpose_state_layout=False, **kwargs):
    calls.append("chunk_kda")
    return _naive(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)


@torch.compiler.disable
def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    calls.append("fused_recurrent_kda")
    return _naive(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)
'''
FAKE_FLA_GDN = '''
import torch

from fla.ops.kda.chunk import _naive

calls = []


@torch.compiler.disable
def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None, **kwargs):
    calls.append("chunk_gated_delta_rule")
    g = g[..., None].expand(*g.shape, k.shape[-1])  # the per-head decay on every key channel
    return _naive(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)


@torch.compiler.disable
def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    calls.append("fused_recurrent_gated_delta_rule")
    g = g[..., None].expand(*g.shape, k.shape[-1])
    return _naive(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)


chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule
'''
FAKE_FLA = {
    "fla/__init__.py": "__version__ = '0.0.fake'\n",
    "fla/ops/__init__.py": "from fla.ops.kda import chunk_kda, fused_recurrent_kda  # noqa\n"
                           "from fla.ops.gated_delta_rule import chunk_gated_delta_rule, chunk_gdn  # noqa\n",
    "fla/ops/gated_delta_rule/__init__.py": "from .chunk import *  # noqa\nfrom .chunk import calls  # noqa\n",
    "fla/ops/gated_delta_rule/chunk.py": FAKE_FLA_GDN,
    "fla/ops/kda/__init__.py": "from .chunk import calls, chunk_kda, fused_recurrent_kda  # noqa\n",
    "fla/ops/kda/chunk.py": FAKE_FLA_KDA,
    "fla/ops/kda/fused_recurrent.py": "from .chunk import fused_recurrent_kda  # noqa\n",
}


def write_fake_fla(root) -> str:
    """Write the fake ``fla`` package under ``root``; ``root`` (to put on the import path)."""
    for rel, text in FAKE_FLA.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return str(root)
