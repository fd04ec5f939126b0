"""Hypothesis strategies that draw valid gated delta rule (GDN) calls.

- :func:`gdn_inputs` draws a complete argument set, a :class:`GDNArgs` dict that calls
  ``chunk_gated_delta_rule(**args)`` and ``fused_recurrent_gated_delta_rule(**args)`` directly;
- :func:`make_gdn_args` builds the same from a shape, options and a seed (fixed regression cases).

Shapes come from :func:`kda_compile.testing.kda_shapes` (T = 1 and odd lengths around the chunk sizes,
grouped value heads ``HV = H * ratio``) and packed sequences from :func:`varlen_splits` (empty sequences
included). Tensor values come from a ``torch.Generator`` seeded by a drawn integer, in the range GDN
layers produce: ``||k|| = 1`` unless the op normalises, ``g <= 0`` (or the raw gate for the in-kernel
``-exp(A_log) * softplus(g + dt_bias)``), ``beta`` in (0, 1), or a logit with the in-kernel sigmoid.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from kda_compile.testing.options import choices
from kda_compile.testing.strategies import DEFAULT_HEAD_DIMS, KDAShape, kda_shapes, varlen_splits

__all__ = ["GDN_GATE_FORMS", "GDNArgs", "gdn_inputs", "make_gdn_args"]

#: ``"precomputed"``: g is the finished log decay; ``"in_kernel"``: the raw gate with ``use_gate_in_kernel``.
GDN_GATE_FORMS = ("precomputed", "in_kernel")


class GDNArgs(dict):
    """Keyword arguments for the GDN functions, plus what drew them: ``shape`` (a
    :class:`~kda_compile.testing.KDAShape`), ``seed``, ``gate_form``, ``num_seqs``."""

    shape: KDAShape
    seed: int
    gate_form: str
    num_seqs: int

    def __repr__(self) -> str:
        opts = {key: value for key, value in self.items()
                if not isinstance(value, torch.Tensor) and value not in (None, False)}
        cu = self.get("cu_seqlens")
        with_ = [key for key in ("initial_state", "A_log", "dt_bias") if self.get(key) is not None]
        layout = "contiguous" if self["q"].is_contiguous() else "non-contiguous"
        return (f"GDNArgs({self.shape}, dtype={self['q'].dtype}, {layout}, gate_form={self.gate_form!r}, "
                f"seed={self.seed}, options={opts}, cu_seqlens={None if cu is None else cu.tolist()}, with={with_})")


def _randn(shape, generator, noncontiguous: bool) -> torch.Tensor:
    """float32 normal values; non-contiguous by allocating T and the heads swapped (HF's [B, H, T, D] layout
    transposed to [B, T, H, D])."""
    if noncontiguous and len(shape) >= 3:
        return torch.randn(shape[0], shape[2], shape[1], *shape[3:], generator=generator).transpose(1, 2)
    return torch.randn(*shape, generator=generator)


def make_gdn_args(
    shape: KDAShape,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    cu_seqlens: Sequence[int] | None = None,
    gate_form: str = "precomputed",
    dt_bias: bool = True,
    initial_state: bool = False,
    output_final_state: bool = True,
    qk_l2norm: bool = False,
    beta_sigmoid: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    noncontiguous: bool = False,
    scale: float | None = None,
    device: str | torch.device = "cpu",
    requires_grad: bool = False,
) -> GDNArgs:
    """One GDN argument set (no hypothesis). States, ``A_log`` and ``dt_bias`` are float32."""
    if gate_form not in GDN_GATE_FORMS:
        raise ValueError(f"gate_form must be one of {GDN_GATE_FORMS}, got {gate_form!r}")
    if allow_neg_eigval and not beta_sigmoid:
        raise ValueError("allow_neg_eigval must come with beta_sigmoid=True (FLA requires it), got beta_sigmoid=False")
    B, T, H, HV, K, V = (shape.batch, shape.seq_len, shape.heads, shape.value_heads, shape.key_dim,
                         shape.value_dim)
    if cu_seqlens is not None and (B != 1 or cu_seqlens[-1] != T):
        raise ValueError(f"cu_seqlens must split the T={T} tokens of one batch row, got B={B}, {list(cu_seqlens)}")
    gen = torch.Generator().manual_seed(seed)
    q = _randn((B, T, H, K), gen, noncontiguous)
    k = _randn((B, T, H, K), gen, noncontiguous)
    if not qk_l2norm:  # the layer normalises before the op
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = _randn((B, T, HV, V), gen, noncontiguous)
    raw_g = _randn((B, T, HV), gen, noncontiguous)
    A_log = dt = None
    if gate_form == "in_kernel":
        g = raw_g
        A_log = torch.empty(HV).uniform_(0.0, math.log(4.0), generator=gen)
        dt = torch.randn(HV, generator=gen) * 0.5 if dt_bias else None
    else:
        g = F.logsigmoid(raw_g + 2.0)  # decays in (0, 1), mostly near 1 as trained layers have them
    beta = _randn((B, T, HV), gen, noncontiguous)
    if not beta_sigmoid:
        beta = torch.sigmoid(beta)
    if noncontiguous:  # the gate and beta activations above allocated contiguous results: transpose them back
        g, beta = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (g, beta))
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    h0 = torch.randn(N, HV, V, K, generator=gen) if initial_state and state_v_first else \
        torch.randn(N, HV, K, V, generator=gen) if initial_state else None
    cast = lambda x: x.to(device=device, dtype=dtype)  # noqa: E731  (keeps the allocated strides)
    leaf = lambda x: x.requires_grad_() if (requires_grad and x is not None) else x  # noqa: E731
    args = GDNArgs(
        q=leaf(cast(q)), k=leaf(cast(k)), v=leaf(cast(v)), g=leaf(cast(g)), beta=leaf(cast(beta)),
        scale=scale, initial_state=leaf(h0.to(device) if h0 is not None else None),
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=qk_l2norm,
        use_gate_in_kernel=gate_form == "in_kernel", A_log=leaf(A_log.to(device) if A_log is not None else None),
        dt_bias=leaf(dt.to(device) if dt is not None else None), use_beta_sigmoid_in_kernel=beta_sigmoid,
        allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
        cu_seqlens=None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32, device=device),
    )
    args.shape, args.seed, args.gate_form, args.num_seqs = shape, seed, gate_form, N
    return args


@st.composite
def gdn_inputs(
    draw,
    *,
    max_batch: int = 2,
    min_T: int = 1,
    max_T: int = 100,
    heads: Sequence[int] = (1, 2),
    gva_ratios: Sequence[int] = (1, 2, 4),
    key_dims: Sequence[int] = DEFAULT_HEAD_DIMS,
    value_dims: Sequence[int] = DEFAULT_HEAD_DIMS,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    varlen: bool | Sequence[bool] = (False, True),
    max_seqs: int = 4,
    gate_forms: str | Sequence[str] = GDN_GATE_FORMS,
    initial_state: bool | Sequence[bool] = (False, True),
    output_final_state: bool | Sequence[bool] = (False, True),
    qk_l2norm: bool | Sequence[bool] = (False, True),
    beta_sigmoid: bool | Sequence[bool] = (False, True),
    allow_neg_eigval: bool | Sequence[bool] = (False, True),
    state_v_first: bool | Sequence[bool] = (False, True),
    noncontiguous: bool | Sequence[bool] = False,
    scales: Sequence[float | None] = (None,),
    device: str | torch.device = "cpu",
    requires_grad: bool = False,
    max_work: int | None = 1_000_000,
) -> GDNArgs:
    """Draw a complete, valid GDN argument set. Every option is one value or a sequence to draw from;
    shape bounds as in :func:`kda_compile.testing.kda_shapes` (``max_work`` bounds B * T * HV * K * V, the
    cost of a token-by-token reference). ``allow_neg_eigval`` is only drawn True with ``beta_sigmoid``."""
    dtypes = choices("dtypes", dtypes)
    gate_forms = choices("gate_forms", gate_forms, GDN_GATE_FORMS)
    flag = {name: choices(name, value, (False, True)) for name, value in dict(
        varlen=varlen, initial_state=initial_state, output_final_state=output_final_state, qk_l2norm=qk_l2norm,
        beta_sigmoid=beta_sigmoid, allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
        noncontiguous=noncontiguous).items()}
    use_varlen = draw(st.sampled_from(flag["varlen"]))
    shape = draw(kda_shapes(max_batch=1 if use_varlen else max_batch, min_T=min_T, max_T=max_T, heads=heads,
                            gva_ratios=gva_ratios, key_dims=key_dims, value_dims=value_dims, max_work=max_work))
    cu_seqlens = draw(varlen_splits(shape.seq_len, max_seqs=max_seqs)) if use_varlen else None
    logit = draw(st.sampled_from(flag["beta_sigmoid"]))
    return make_gdn_args(
        shape, seed=draw(st.integers(0, 2**31 - 1)), dtype=draw(st.sampled_from(dtypes)), cu_seqlens=cu_seqlens,
        gate_form=draw(st.sampled_from(gate_forms)), dt_bias=draw(st.booleans()),
        initial_state=draw(st.sampled_from(flag["initial_state"])),
        output_final_state=draw(st.sampled_from(flag["output_final_state"])),
        qk_l2norm=draw(st.sampled_from(flag["qk_l2norm"])), beta_sigmoid=logit,
        allow_neg_eigval=logit and draw(st.sampled_from(flag["allow_neg_eigval"])),
        state_v_first=draw(st.sampled_from(flag["state_v_first"])),
        noncontiguous=draw(st.sampled_from(flag["noncontiguous"])),
        scale=draw(st.sampled_from(choices("scales", scales))),
        device=device, requires_grad=requires_grad)
