"""Hypothesis strategies that draw valid Kimi Delta Attention (KDA) arguments.

Building blocks:
- :func:`kda_shapes` draws a :class:`KDAShape` (B, T, H, HV, K, V) under bounds;
- :func:`varlen_splits` draws ``cu_seqlens`` offsets that split T tokens into sequences, empty
  sequences included;
- :func:`kda_inputs` draws a complete argument set, a :class:`KDAArgs` dict that calls
  ``chunk_kda(**args)`` and ``fused_recurrent_kda(**args)`` directly;
- :func:`make_kda_args` builds the same argument set without hypothesis, from a shape, options
  and a seed (for fixed regression cases).

Tensor VALUES come from a ``torch.Generator`` seeded by a drawn integer: hypothesis explores and
shrinks shapes and options, while the values stay cheap to make and reproducible from the seed.
Values are in the range the KDA layer produces, so the recurrence stays stable (``||k|| = 1``
unless the op normalises, ``g <= 0``, ``beta`` in (0, 1) or (0, 2) with negative eigenvalues).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from kda_compile.testing.options import choices, positive_ints

__all__ = [
    "DEFAULT_HEAD_DIMS",
    "GATE_FORMS",
    "KDAArgs",
    "KDAShape",
    "kda_inputs",
    "kda_shapes",
    "make_kda_args",
    "varlen_splits",
]

#: K and V sizes drawn by default: powers of two and the odd sizes that broke kernels before.
DEFAULT_HEAD_DIMS = (16, 32, 60, 64, 100, 128)
#: How the gate reaches the op: a finished log-decay, or the raw projection gated in the kernel.
GATE_FORMS = ("precomputed", "softplus", "lower_bound")
#: Sequence lengths around chunk boundaries (16 and 64) that kernels get wrong most often.
_EDGE_LENGTHS = (1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257)


@dataclass(frozen=True)
class KDAShape:
    """Sizes of one KDA call. With varlen, ``batch`` is 1 and ``seq_len`` counts packed tokens."""

    batch: int  # B
    seq_len: int  # T
    heads: int  # H, the q/k heads
    value_heads: int  # HV, a multiple of H (GVA when larger)
    key_dim: int  # K
    value_dim: int  # V

    @property
    def work(self) -> int:
        """B * T * HV * K * V: the cost of one token-by-token reference pass."""
        return self.batch * self.seq_len * self.value_heads * self.key_dim * self.value_dim


class KDAArgs(dict):
    """Keyword arguments for ``chunk_kda`` / ``fused_recurrent_kda``, plus what drew them.

    Keys: ``q, k, v, g, beta, scale, initial_state, output_final_state,
    use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
    lower_bound, cu_seqlens, state_v_first, A_log, dt_bias`` (every key both functions accept).
    Attributes: ``shape`` (:class:`KDAShape`), ``seed``, ``gate_form``, ``num_seqs`` (N, the
    number of states). The repr is a one-line summary, so a falsifying example stays readable.
    """

    shape: KDAShape
    seed: int
    gate_form: str
    num_seqs: int

    def __repr__(self) -> str:
        opts = {
            key: value
            for key, value in self.items()
            if not isinstance(value, torch.Tensor) and value not in (None, False)
        }
        tensors = []
        for key in ("initial_state", "cu_seqlens", "A_log", "dt_bias"):
            value = self.get(key)
            if isinstance(value, torch.Tensor):
                tensors.append(key if key != "cu_seqlens" else f"cu_seqlens={value.tolist()}")
        q = self["q"]
        layout = "contiguous" if q.is_contiguous() else f"strides {q.stride()}"
        return (
            f"KDAArgs({self.shape}, dtype={q.dtype}, device={q.device}, {layout}, "
            f"gate_form={self.gate_form!r}, seed={self.seed}, options={opts}, with={tensors})"
        )


def _lengths(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Lengths in [lo, hi], biased towards chunk boundaries."""
    edges = [t for t in _EDGE_LENGTHS if lo <= t <= hi]
    uniform = st.integers(lo, hi)
    return st.one_of(st.sampled_from(edges), uniform) if edges else uniform


@st.composite
def kda_shapes(
    draw,
    *,
    max_batch: int = 2,
    min_T: int = 1,
    max_T: int = 128,
    heads: Sequence[int] = (1, 2),
    gva_ratios: Sequence[int] = (1, 2),
    key_dims: Sequence[int] = DEFAULT_HEAD_DIMS,
    value_dims: Sequence[int] = DEFAULT_HEAD_DIMS,
    max_work: int | None = None,
) -> KDAShape:
    """Draw a :class:`KDAShape`.

    Args:
        max_batch: B is drawn from 1..max_batch.
        min_T, max_T: T is drawn from min_T..max_T (0 allowed), favouring lengths next to the
            chunk sizes 16 and 64.
        heads: choices for H.
        gva_ratios: choices for HV // H (1 = no grouped value attention).
        key_dims, value_dims: choices for K (<= 256) and V.
        max_work: if given, B and T are reduced so that B * T * HV * K * V stays within it (never
            below B = 1, T = min_T): it bounds the cost of a token-by-token reference.
    """
    if not (isinstance(max_batch, int) and max_batch >= 1):
        raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
    if not (isinstance(min_T, int) and isinstance(max_T, int) and 0 <= min_T <= max_T):
        raise ValueError(f"min_T and max_T must be integers with 0 <= min_T <= max_T, got {min_T!r}, {max_T!r}")
    key_dims = positive_ints("key_dims", key_dims)
    if max(key_dims) > 256:
        raise ValueError(f"key_dims must be <= 256 (the KDA limit on K), got {key_dims!r}")
    K = draw(st.sampled_from(key_dims))
    V = draw(st.sampled_from(positive_ints("value_dims", value_dims)))
    H = draw(st.sampled_from(positive_ints("heads", heads)))
    HV = H * draw(st.sampled_from(positive_ints("gva_ratios", gva_ratios)))
    per_token = HV * K * V
    b_hi, t_hi = max_batch, max_T
    if max_work is not None:
        b_hi = max(1, min(max_batch, max_work // max(1, min_T * per_token)))
    B = draw(st.integers(1, b_hi))
    if max_work is not None:
        t_hi = max(min_T, min(max_T, max_work // (B * per_token)))
    T = draw(_lengths(min_T, t_hi))
    return KDAShape(B, T, H, HV, K, V)


@st.composite
def varlen_splits(draw, total_tokens: int, *, max_seqs: int = 4, allow_empty: bool = True) -> list[int]:
    """Draw ``cu_seqlens`` offsets ``[0, ..., total_tokens]`` splitting the tokens into sequences.

    Args:
        total_tokens: T, the packed length.
        max_seqs: at most this many sequences (at least one).
        allow_empty: allow zero-length sequences (repeated offsets), at the ends too.
    Returns:
        A non-decreasing list of ints starting at 0 and ending at total_tokens.
    """
    if not (isinstance(total_tokens, int) and total_tokens >= 0):
        raise ValueError(f"total_tokens must be an integer >= 0, got {total_tokens!r}")
    if not (isinstance(max_seqs, int) and max_seqs >= 1):
        raise ValueError(f"max_seqs must be an integer >= 1, got {max_seqs!r}")
    if allow_empty:
        num = draw(st.integers(1, max_seqs))
        cuts = draw(st.lists(st.integers(0, total_tokens), min_size=num - 1, max_size=num - 1))
    else:
        if total_tokens == 0:
            raise ValueError("total_tokens must be >= 1 when allow_empty is False, got 0")
        num = draw(st.integers(1, min(max_seqs, total_tokens)))
        cuts = draw(
            st.lists(st.integers(1, total_tokens - 1), min_size=num - 1, max_size=num - 1, unique=True)
            if total_tokens > 1
            else st.just([])
        )
    return [0, *sorted(cuts), total_tokens]


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows of unit L2 norm (what the KDA layer feeds when the op does not normalise)."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)


def _make(shape, generator, *, noncontiguous: bool, transpose: tuple[int, int], fn=None):
    """A float32 random tensor of ``shape``; non-contiguous by allocating it transposed."""
    if noncontiguous:
        a, b = transpose
        alloc = list(shape)
        alloc[a], alloc[b] = alloc[b], alloc[a]
        x = torch.randn(alloc, generator=generator).transpose(a, b)
        x = fn(x) if fn is not None else x
        # fn may have produced a fresh contiguous tensor: re-materialise in the transposed layout.
        return x.transpose(a, b).contiguous().transpose(a, b)
    x = torch.randn(list(shape), generator=generator)
    return fn(x) if fn is not None else x


@st.composite
def kda_inputs(
    draw,
    *,
    max_batch: int = 2,
    min_T: int = 1,
    max_T: int = 128,
    heads: Sequence[int] = (1, 2),
    gva_ratios: Sequence[int] = (1, 2),
    key_dims: Sequence[int] = DEFAULT_HEAD_DIMS,
    value_dims: Sequence[int] = DEFAULT_HEAD_DIMS,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
    varlen: bool | Sequence[bool] = (False, True),
    max_seqs: int = 4,
    gate_forms: str | Sequence[str] = GATE_FORMS,
    initial_state: bool | Sequence[bool] = (False, True),
    output_final_state: bool | Sequence[bool] = (False, True),
    qk_l2norm: bool | Sequence[bool] = (False, True),
    beta_sigmoid: bool | Sequence[bool] = (False, True),
    allow_neg_eigval: bool | Sequence[bool] = False,
    state_v_first: bool | Sequence[bool] = False,
    noncontiguous: bool | Sequence[bool] = False,
    scales: Sequence[float | None] = (None,),
    device: str | torch.device = "cpu",
    requires_grad: bool = False,
    max_work: int | None = 4_000_000,
) -> KDAArgs:
    """Draw a complete, valid argument set for ``chunk_kda`` / ``fused_recurrent_kda``.

    Every option is one value or a sequence to draw from. Shape bounds are those of
    :func:`kda_shapes`; with varlen, B is 1 and the T tokens are split by :func:`varlen_splits`
    into at most ``max_seqs`` sequences (empty ones included).

    Args:
        dtypes: dtype of q, k, v, g, beta (outputs come back in it); states, ``A_log`` and
            ``dt_bias`` are always float32.
        gate_forms: ``"precomputed"`` (g is the log-decay, ``use_gate_in_kernel=False``),
            ``"softplus"`` (g is the raw projection, ``-exp(A_log) * softplus(g + dt_bias)``),
            ``"lower_bound"`` (raw projection, ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``,
            ``A_log`` and ``dt_bias`` each sometimes ``None``).
        initial_state, output_final_state, state_v_first: state options.
        qk_l2norm: ``use_qk_l2norm_in_kernel``; without it q and k are drawn with unit rows.
        beta_sigmoid: ``use_beta_sigmoid_in_kernel`` (beta drawn as a logit).
        allow_neg_eigval: only drawn True together with ``beta_sigmoid``.
        noncontiguous: make every tensor input non-contiguous (allocated with two dims swapped).
        scales: choices for ``scale`` (``None`` = K ** -0.5).
        device: where the tensors live (values are generated on CPU, then moved).
        requires_grad: make every floating-point tensor input a leaf that requires grad.
        max_work: bound on B * T * HV * K * V (see :func:`kda_shapes`); ``None`` for no bound.

    Example::

        @given(kda_inputs(max_T=200, dtypes=(torch.bfloat16,)))
        def test_mine(args):
            o, state = my_kda(**args)
    """
    dtypes = choices("dtypes", dtypes)
    if not all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtypes):
        raise ValueError(f"dtypes must be floating-point torch dtypes, got {dtypes!r}")
    gate_forms = choices("gate_forms", gate_forms, GATE_FORMS)
    bools = {
        name: choices(name, value, (False, True))
        for name, value in dict(
            varlen=varlen,
            initial_state=initial_state,
            output_final_state=output_final_state,
            qk_l2norm=qk_l2norm,
            beta_sigmoid=beta_sigmoid,
            allow_neg_eigval=allow_neg_eigval,
            state_v_first=state_v_first,
            noncontiguous=noncontiguous,
        ).items()
    }
    if bools["allow_neg_eigval"] == (True,) and bools["beta_sigmoid"] == (False,):
        raise ValueError("allow_neg_eigval must come with beta_sigmoid=True (FLA requires it), got beta_sigmoid=False")
    scales = choices("scales", scales)

    use_varlen = draw(st.sampled_from(bools["varlen"]))
    shape = draw(
        kda_shapes(
            max_batch=1 if use_varlen else max_batch,
            min_T=min_T,
            max_T=max_T,
            heads=heads,
            gva_ratios=gva_ratios,
            key_dims=key_dims,
            value_dims=value_dims,
            max_work=max_work,
        )
    )
    cu_seqlens = draw(varlen_splits(shape.seq_len, max_seqs=max_seqs)) if use_varlen else None
    gate_form = draw(st.sampled_from(gate_forms))
    beta_logit = draw(st.sampled_from(bools["beta_sigmoid"]))
    return make_kda_args(
        shape,
        seed=draw(st.integers(0, 2**31 - 1)),
        dtype=draw(st.sampled_from(dtypes)),
        cu_seqlens=cu_seqlens,
        gate_form=gate_form,
        A_log=gate_form == "softplus" or (gate_form == "lower_bound" and draw(st.booleans())),
        dt_bias=gate_form != "precomputed" and draw(st.booleans()),
        lower_bound=draw(st.sampled_from((-5.0, -3.0, -1.0, -0.5))) if gate_form == "lower_bound" else None,
        initial_state=draw(st.sampled_from(bools["initial_state"])),
        output_final_state=draw(st.sampled_from(bools["output_final_state"])),
        qk_l2norm=draw(st.sampled_from(bools["qk_l2norm"])),
        beta_sigmoid=beta_logit,
        allow_neg_eigval=beta_logit and draw(st.sampled_from(bools["allow_neg_eigval"])),
        state_v_first=draw(st.sampled_from(bools["state_v_first"])),
        noncontiguous=draw(st.sampled_from(bools["noncontiguous"])),
        scale=draw(st.sampled_from(scales)),
        device=device,
        requires_grad=requires_grad,
    )


def make_kda_args(
    shape: KDAShape,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    cu_seqlens: Sequence[int] | None = None,
    gate_form: str = "precomputed",
    A_log: bool = True,
    dt_bias: bool = True,
    lower_bound: float | None = None,
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
) -> KDAArgs:
    """Build one argument set deterministically from ``seed`` (what :func:`kda_inputs` draws).

    Args:
        shape: the sizes; with ``cu_seqlens`` (a list of offsets), ``shape.batch`` must be 1.
        gate_form: one of :data:`GATE_FORMS`. ``A_log`` / ``dt_bias``: include those tensors
            (used by the in-kernel gate forms only; ``"softplus"`` always has ``A_log``).
            ``lower_bound``: the bound of the ``"lower_bound"`` form (default -3.0).
        The other options are those of :func:`kda_inputs`, one value each.
    """
    if gate_form not in GATE_FORMS:
        raise ValueError(f"gate_form must be one of {GATE_FORMS}, got {gate_form!r}")
    if allow_neg_eigval and not beta_sigmoid:
        raise ValueError("allow_neg_eigval must come with beta_sigmoid=True (FLA requires it), got beta_sigmoid=False")
    B, T, H, HV, K, V = (shape.batch, shape.seq_len, shape.heads, shape.value_heads, shape.key_dim, shape.value_dim)
    if cu_seqlens is not None:
        cu_seqlens = [int(x) for x in cu_seqlens]
        if B != 1 or cu_seqlens[0] != 0 or cu_seqlens[-1] != T or cu_seqlens != sorted(cu_seqlens):
            raise ValueError(
                f"cu_seqlens must be non-decreasing offsets from 0 to T={T} with batch 1, got {cu_seqlens} "
                f"with batch {B}"
            )
    N = len(cu_seqlens) - 1 if cu_seqlens is not None else B
    gen = torch.Generator().manual_seed(seed)

    # [B, T, X, D] tensors are allocated as [B, X, T, D] when non-contiguous.
    def make(shape_, fn=None, transpose=(1, 2)):
        return _make(shape_, gen, noncontiguous=noncontiguous, transpose=transpose, fn=fn)

    q = make((B, T, H, K), None if qk_l2norm else _unit_rows)
    k = make((B, T, H, K), None if qk_l2norm else _unit_rows)
    if qk_l2norm:  # the op normalises: give it un-normalised rows of varied size
        q, k = q * 2.0, k * 0.5
    v = make((B, T, HV, V))
    beta = make((B, T, HV), None if beta_sigmoid else torch.sigmoid)

    args = KDAArgs(use_gate_in_kernel=gate_form != "precomputed", lower_bound=None, A_log=None, dt_bias=None)
    if gate_form == "precomputed":
        g = make((B, T, HV, K), F.logsigmoid)
    else:
        g = make((B, T, HV, K))  # the raw projection f
        if A_log or gate_form == "softplus":  # A = exp(A_log) in [1, 16], the Kimi-Linear initialisation
            args["A_log"] = torch.empty(HV).uniform_(0.0, math.log(16.0), generator=gen)
        if dt_bias:
            args["dt_bias"] = torch.randn(HV * K, generator=gen) * 0.5 - 1.0
        if gate_form == "lower_bound":
            args["lower_bound"] = -3.0 if lower_bound is None else float(lower_bound)

    state = None
    if initial_state:
        state_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        state = _make(state_shape, gen, noncontiguous=noncontiguous, transpose=(2, 3)) * 0.5

    args.update(
        q=q.to(dtype),
        k=k.to(dtype),
        v=v.to(dtype),
        g=g.to(dtype),
        beta=beta.to(dtype),
        scale=scale,
        initial_state=state,
        output_final_state=bool(output_final_state),
        use_qk_l2norm_in_kernel=bool(qk_l2norm),
        use_beta_sigmoid_in_kernel=bool(beta_sigmoid),
        allow_neg_eigval=bool(allow_neg_eigval),
        cu_seqlens=None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.long),
        state_v_first=bool(state_v_first),
    )
    for key, value in list(args.items()):
        if isinstance(value, torch.Tensor):
            value = value.to(device)
            if requires_grad and value.is_floating_point():
                value = value.detach().requires_grad_(True)
            args[key] = value
    args.shape, args.seed, args.gate_form, args.num_seqs = shape, seed, gate_form, N
    return args
