"""The fp64 token-by-token KDA recurrence the tests trust, and the harness comparing an op with it.

Written from docs/kda.md section 1, independently of the ops under test:

    S'  = diag(exp(g_t)) S
    u   = beta_t * (v_t - S'^T k_t)
    S   = S' + k_t u^T
    o_t = S^T (scale * q_t)

plain Python loop over tokens, vectorised over batch and heads, float64 throughout, with every
input option of the FLA contract (in-kernel L2 norm, gates and beta sigmoid, GVA, varlen, state
layouts) applied here in plain torch. It is differentiable by autograd, which gives the reference
gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kda_compile.testing import assert_rel_close, rel_error

F64 = torch.float64

# Relative-error tolerances ||a - b|| / ||b|| against this recurrence.
# - bf16 (and fp16): kda.md section 7, FLA's own kernel tests: o and final state 5e-3, dq/dk/dv
#   8e-3, dg/dbeta 2e-2; dh0 follows dv, dA_log / ddt_bias follow dg (they are sums of dg terms).
# - fp32: the op computes in fp32, so only fp32 rounding through the chunked algorithm remains
#   (measured worst over 300 fuzzed cases: o 1e-6, dq/dk/dv 2e-6, dg 2e-5, dbeta 5e-5). dA_log is a
#   sum over T * K terms that cancel (|dA_log| ~ 1e-3 * sum |terms| measured), so its fp32 error is
#   cond * eps ~ 1e-3 (measured 9e-4; the same case in fp64 through the op agrees to 4e-12).
# - fp64: the op's math in fp64 must equal the recurrence up to rounding; states, A_log and dt_bias
#   (and so their gradients) are float32 by contract, hence 1e-7 on those.
_HALF = dict(o=5e-3, final_state=5e-3, q=8e-3, k=8e-3, v=8e-3, g=2e-2, beta=2e-2,
             initial_state=8e-3, A_log=2e-2, dt_bias=2e-2)
TOLERANCES = {
    torch.bfloat16: _HALF,
    torch.float16: _HALF,
    torch.float32: dict(o=1e-4, final_state=1e-4, q=1e-4, k=1e-4, v=1e-4, g=5e-4, beta=5e-4,
                        initial_state=1e-4, A_log=5e-3, dt_bias=5e-4),
    torch.float64: dict(o=1e-10, final_state=1e-7, q=1e-10, k=1e-10, v=1e-10, g=1e-9, beta=1e-9,
                        initial_state=1e-7, A_log=1e-7, dt_bias=1e-7),
}

#: fp32 inputs on CUDA: FLA's kernels run their fp32 matrix products as TF32 on tensor cores (about
#: 1e-3 relative error per product), so fp32 on CUDA is held to TF32-level tolerances.
TF32_TOLERANCES = dict(o=2e-3, final_state=2e-3, q=3e-3, k=3e-3, v=3e-3, g=1e-2, beta=1e-2,
                       initial_state=3e-3, A_log=2e-2, dt_bias=1e-2)

def tolerances_for(dtype: torch.dtype, device) -> dict:
    """The relative-error tolerances of a comparison in ``dtype`` on ``device``."""
    if dtype == torch.float32 and torch.device(device).type == "cuda":
        return dict(TF32_TOLERANCES)
    return dict(TOLERANCES[dtype])


#: Unit roundoff of the products an op computes for inputs of each dtype (fp32 on CUDA: TF32 operands).
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}
TF32_UNIT_ROUNDOFF = 2.0 ** -11
#: The conditioning the output tolerances above were set on: typical drawn inputs (T >= 64) measure 1.1-1.2 by
#: ``conditioning``; a single token whose output is one cancelling dot product measures 3-20.
CALIBRATED_CONDITIONING = 1.25
#: The most an output tolerance is scaled by its measured conditioning.
MAX_CONDITIONING_SCALE = 10.0
#: Inputs a rounded kernel perturbs, for ``conditioning`` (g enters through fp32 cumulative sums).
ROUNDED_INPUTS = ("q", "k", "v", "beta")


def unit_roundoff(dtype: torch.dtype, device) -> float | None:
    """The unit roundoff of an op's products for ``dtype`` inputs on ``device``; None for float64."""
    if dtype == torch.float32 and torch.device(device).type == "cuda":
        return TF32_UNIT_ROUNDOFF
    return UNIT_ROUNDOFF.get(dtype)


def conditioning(args: dict, unit: float, *, with_grads: bool = False, seed: int = 0, draws: int = 8,
                 base: RunResult | None = None) -> dict[str, float]:
    """How ill-conditioned the exact results are: for o, the final state and (``with_grads``) each gradient,
    the largest relative change when q, k, v and beta are multiplied by ``1 + unit * r`` (r uniform in
    [-1, 1], ``draws`` fixed draws), divided by ``unit``. An op that rounds those inputs' intermediates cannot
    be held closer than about this times ``unit``; ``compare_with_recurrence`` scales a failing result's
    tolerance by it. ``base``: ``reference(args, ...)`` when the caller has it already."""
    if base is None:
        base = reference(args, with_grads=with_grads, seed=seed)
    worst: dict[str, float] = {}
    for draw in range(draws):
        gen = torch.Generator().manual_seed(draw)
        perturbed = dict(args)
        for name in ROUNDED_INPUTS:
            value = args.get(name)
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                noise = 2 * torch.rand(value.shape, generator=gen, dtype=F64) - 1
                perturbed[name] = value.detach().to(F64) * (1 + unit * noise.to(value.device))
        moved = reference(perturbed, with_grads=with_grads, seed=seed)
        pairs = [("o", moved.o, base.o, 0.0)]
        if base.final_state is not None:
            pairs.append(("final_state", moved.final_state, base.final_state, 0.0))
        pairs += [("d" + name, moved.grads[name], grad, grad_floor(grad)) for name, grad in base.grads.items()]
        for name, a, b, floor in pairs:
            worst[name] = max(worst.get(name, 0.0), rel_error(a, b, floor=floor))
    return {name: value / unit for name, value in worst.items()}


#: Inputs a KDA op is differentiable in (when present and floating point).
GRAD_INPUTS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def l2norm_fp(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x * x) + 1e-6) over the last dim (eps inside the sqrt, as FLA and HF)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gate_in_kernel(f, A_log, dt_bias, lower_bound):
    """The gate the op applies to a raw projection ``f`` [B, T, HV, K]."""
    HV, K = f.shape[-2], f.shape[-1]
    if dt_bias is not None:
        f = f + dt_bias.view(HV, K)
    if lower_bound is None:
        decay = torch.exp(A_log).view(HV, 1) if A_log is not None else 1.0
        return -decay * F.softplus(f)
    if A_log is not None:
        f = torch.exp(A_log).view(HV, 1) * f
    return lower_bound * torch.sigmoid(f)


def _scan(q, k, v, g, beta, state):
    """Token loop. q, k, g [N, T, HV, K]; v [N, T, HV, V]; beta [N, T, HV]; state [N, HV, K, V]."""
    outputs = []
    for t in range(q.shape[1]):
        state = state * torch.exp(g[:, t]).unsqueeze(-1)
        k_t = k[:, t]
        residual = v[:, t] - torch.einsum("nhk,nhkv->nhv", k_t, state)
        u = beta[:, t].unsqueeze(-1) * residual
        state = state + k_t.unsqueeze(-1) * u.unsqueeze(-2)
        outputs.append(torch.einsum("nhk,nhkv->nhv", q[:, t], state))
    o = torch.stack(outputs, 1) if outputs else v.new_zeros(v.shape)
    return o, state


def kda_recurrence(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False, lower_bound=None, cu_seqlens=None, state_v_first=False,
    A_log=None, dt_bias=None, safe_gate=False, chunk_size=64,
):
    """KDA in float64 by the token recurrence; same arguments as ``chunk_kda``.

    Shapes: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV];
    initial_state [N, HV, K, V] ([N, HV, V, K] when state_v_first).
    Returns (o [B, T, HV, V] float64, final state float64 or None). ``safe_gate`` and
    ``chunk_size`` change how a kernel works, not what it computes: ignored.
    """
    del safe_gate, chunk_size
    q, k, v, g, beta = (x.to(F64) for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV = v.shape[2]
    if use_qk_l2norm_in_kernel:
        q, k = l2norm_fp(q), l2norm_fp(k)
    q = q * (K ** -0.5 if scale is None else scale)
    # GVA: value head hv reads q/k head hv // (HV // H).
    q = q.repeat_interleave(HV // H, dim=2)
    k = k.repeat_interleave(HV // H, dim=2)
    if use_gate_in_kernel:
        to64 = lambda x: None if x is None else x.to(F64)  # noqa: E731
        g = gate_in_kernel(g, to64(A_log), to64(dt_bias), lower_bound)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)

    if cu_seqlens is None:
        bounds = None
        N = B
    else:
        bounds = [int(x) for x in cu_seqlens.tolist()]
        N = len(bounds) - 1
    if initial_state is None:
        h0 = q.new_zeros(N, HV, K, v.shape[-1])
    else:
        h0 = initial_state.to(F64)
        h0 = h0.transpose(-1, -2) if state_v_first else h0

    if bounds is None:
        o, ht = _scan(q, k, v, g, beta, h0)
    else:
        outs, states = [], []
        for n in range(N):
            span = slice(bounds[n], bounds[n + 1])
            o_n, s_n = _scan(q[:, span], k[:, span], v[:, span], g[:, span], beta[:, span], h0[n : n + 1])
            outs.append(o_n)
            states.append(s_n)
        o = torch.cat(outs, 1) if outs else v.new_zeros(v.shape)
        ht = torch.cat(states, 0)
    if not output_final_state:
        return o, None
    return o, (ht.transpose(-1, -2) if state_v_first else ht)


# ----------------------------------------------------------------------------------------------
# Harness: run an op and the recurrence on the same inputs, with the same output cotangents.
# ----------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    o: torch.Tensor
    final_state: torch.Tensor | None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


def grad_names(args: dict) -> list[str]:
    return [n for n in GRAD_INPUTS if isinstance(args.get(n), torch.Tensor) and args[n].is_floating_point()]


def cotangents(args: dict, seed: int = 0):
    """Random cotangents (do, dht) for o and the final state, made on CPU for reproducibility."""
    gen = torch.Generator().manual_seed(seed)
    q, v = args["q"], args["v"]
    do = torch.randn(v.shape, generator=gen).to(device=q.device, dtype=q.dtype)
    N = len(args["cu_seqlens"]) - 1 if args.get("cu_seqlens") is not None else q.shape[0]
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    shape = (N, HV, V, K) if args.get("state_v_first") else (N, HV, K, V)
    dht = torch.randn(shape, generator=gen).to(q.device)
    return do, dht


def run(fn, args: dict, *, with_grads: bool, seed: int = 0, cast=None) -> RunResult:
    """Call ``fn(**args)`` on detached copies (cast by ``cast`` if given); grads of every input."""
    names = grad_names(args) if with_grads else []
    call = {}
    for key, value in args.items():
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if cast is not None and value.is_floating_point():
                value = cast(value)
            if key in names:
                value = value.requires_grad_(True)
        call[key] = value
    o, ht = fn(**call)
    result = RunResult(o.detach(), None if ht is None else ht.detach())
    if names:
        do, dht = cotangents(args, seed)
        outs, cots = [o], [do.to(o.dtype)]
        if ht is not None:
            outs.append(ht)
            cots.append(dht.to(ht.dtype))
        grads = torch.autograd.grad(outs, [call[n] for n in names], cots, allow_unused=True)
        for name, grad in zip(names, grads):
            result.grads[name] = torch.zeros_like(call[name]) if grad is None else grad.detach()
    return result


def reference(args: dict, *, with_grads: bool, seed: int = 0) -> RunResult:
    """The recurrence on the op's exact (already rounded) inputs, upcast to float64."""
    return run(kda_recurrence, args, with_grads=with_grads, seed=seed, cast=lambda x: x.to(F64))


def grad_floor(grad: torch.Tensor) -> float:
    """Smallest norm a gradient is divided by: an RMS of 1e-3, for O(1) inputs and cotangents.

    A gradient that is 0 by construction (dg at T = 1 from a zero state, dq when beta = 0) comes
    out of the chunked algorithm as fp32 rounding noise of O(1e-8) left by cancelling O(1) terms;
    dividing by its exact norm (0) would call that an infinite error. Real gradients here have RMS
    1e-2 .. 1, so the floor only acts on those degenerate cases (absolute RMS tol * 1e-3 there).
    """
    return 1e-3 * grad.numel() ** 0.5


def compare_with_recurrence(op, args: dict, *, with_grads: bool = True, tolerances=None, seed: int = 0):
    """Run ``op(**args)`` and the recurrence; assert o, final state and every gradient match.

    Also checks the output contract: o in q's dtype and shape [B, T, HV, V], final state float32
    of the state layout, None unless requested. Returns {name: relative error}.
    """
    tol = tolerances_for(args["q"].dtype, args["q"].device)
    tol.update(tolerances or {})
    got = run(op, args, with_grads=with_grads, seed=seed)
    want = reference(args, with_grads=with_grads, seed=seed)
    errors = {}
    assert got.o.dtype == args["q"].dtype, f"o must come back in q's dtype {args['q'].dtype}, got {got.o.dtype}"
    assert got.o.shape == want.o.shape, f"o shape {list(got.o.shape)} != {list(want.o.shape)}"
    judge = _Conditioning(args, with_grads, seed, want)
    errors["o"] = judge.assert_close("o", got.o, want.o, tol["o"])
    if args.get("output_final_state"):
        assert got.final_state is not None, "final_state is None although output_final_state=True"
        assert got.final_state.dtype == torch.float32, f"final_state must be float32, got {got.final_state.dtype}"
        assert got.final_state.shape == want.final_state.shape, (
            f"final_state shape {list(got.final_state.shape)} != {list(want.final_state.shape)}"
        )
        errors["final_state"] = judge.assert_close("final_state", got.final_state, want.final_state,
                                                   tol["final_state"])
    else:
        assert got.final_state is None, "final_state must be None unless output_final_state=True"
    for name, grad in want.grads.items():
        actual = got.grads[name]
        assert actual.shape == grad.shape, f"d{name} shape {list(actual.shape)} != {list(grad.shape)}"
        errors["d" + name] = judge.assert_close("d" + name, actual, grad, tol[name], floor=grad_floor(grad))
    return errors


class _Conditioning:
    """``conditioning`` of one comparison, measured once and only when a result misses its tolerance."""

    def __init__(self, args: dict, with_grads: bool, seed: int, want: RunResult | None = None):
        self.args, self.with_grads, self.seed, self.want, self.kappa = args, with_grads, seed, want, None
        self.unit = unit_roundoff(args["q"].dtype, args["q"].device)

    def assert_close(self, name: str, actual, expected, tol: float, *, floor: float = 0.0) -> float:
        """``assert_rel_close``; a result that misses ``tol`` is held to ``tol`` scaled by its measured
        conditioning over the calibrated one (at most ``MAX_CONDITIONING_SCALE``), so a cancelling
        single-token result is not judged as if it were well-conditioned. NaN never passes."""
        if not rel_error(actual, expected, floor=floor) <= tol and self.unit is not None:
            if self.kappa is None:
                self.kappa = conditioning(self.args, self.unit, with_grads=self.with_grads, seed=self.seed,
                                          base=self.want)
            kappa = self.kappa.get(name, 0.0)
            scale = min(max(kappa / CALIBRATED_CONDITIONING, 1.0), MAX_CONDITIONING_SCALE)
            if scale > 1.0:
                tol, name = tol * scale, f"{name} (tolerance x {scale:.2f}: measured conditioning {kappa:.2f})"
        return assert_rel_close(actual, expected, tol, name=name, floor=floor)


def worst_errors(op, args: dict, *, with_grads: bool = True, seed: int = 0) -> dict[str, float]:
    """Relative errors without asserting: used to report margins and pick tolerances."""
    got = run(op, args, with_grads=with_grads, seed=seed)
    want = reference(args, with_grads=with_grads, seed=seed)
    errors = {"o": rel_error(got.o, want.o)}
    if want.final_state is not None and got.final_state is not None:
        errors["final_state"] = rel_error(got.final_state, want.final_state)
    for name, grad in want.grads.items():
        errors["d" + name] = rel_error(got.grads[name], grad, floor=grad_floor(grad))
    return errors
