"""Context-parallel KDA and GDN prefill (docs/context-parallel.md) against the one-process op.

Each test starts 2 or 3 CPU processes joined by a gloo group (tests/distributed/spawn.py). Every rank builds
the same global inputs from a seed, runs the one-process op on all of them (forward and gradients of a
random linear loss), then its own slice with ``cp_context``, and compares: outputs, final states (the
sequence's own on the rank holding its end; on a rank that passes a sequence on, the state after its slice,
against a one-process run of the prefix), and the gradients of q, k, v, g, beta, initial_state, A_log and
dt_bias (the last two summed over ranks, as data parallelism would). Relative error, NaN never passes:
``TOL`` per dtype; ``KDA_TEST_REPORT_ERRORS=1`` prints every measured error (with ``pytest -s``, no xdist).

Layouts: one sequence over 2 and 3 ranks (a middle rank), packed sequences crossing 0, 1 and 2 rank
boundaries, empty sequences, uneven slices, boundaries that fall between sequences (no communication).
The ``cuda`` variants run the same checks with NCCL on 2 GPUs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from kda_compile.ops import build_cp_context, chunk_gated_delta_rule, chunk_kda
from kda_compile.testing import rel_error

from .spawn import run_in_processes

# Largest relative error accepted against the one-process op on the same backend (the reference math on CPU).
# float64 inputs: the ops return float32 states, so the state crossing a rank boundary is rounded to float32
# where one process keeps float64 (measured: about 1e-8).
TOL = {torch.float64: 1e-6, torch.float32: 2e-6}
# On the GPU: the one-process op and the context-parallel call both run our CUDA backends in this dtype.
TOL_CUDA = {torch.bfloat16: 3e-2, torch.float32: 5e-3}
SMALL = (1, 2, 8, 6)  # H, HV, K, V: grouped value heads, V != K (the extra state columns must not mix with v's)


@dataclass(frozen=True)
class Case:
    """One call: the rule, the packed layout and the options."""
    rule: str  # "kda" or "gdn"
    seq_lengths: tuple[int, ...]
    slice_lengths: tuple[int, ...]
    dtype: torch.dtype = torch.float64
    initial_state: bool = True
    output_final_state: bool = True
    state_v_first: bool = False
    options: dict = field(default_factory=dict)
    seed: int = 0
    dims: tuple[int, int, int, int] = SMALL
    tol: float | None = None  # default: TOL[dtype]


KDA_GATE = {"use_gate_in_kernel": True, "use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True}

# (world size, cases): every boundary kind on KDA, then the same layouts on GDN.
KDA_2 = [
    Case("kda", (20,), (10, 10), options={**KDA_GATE, "chunk_size": 16}),  # one sequence, 1 boundary
    Case("kda", (5, 0, 9, 6, 3), (11, 12), seed=1),  # packed: crossing 1 boundary, others 0, an empty one
    Case("kda", (8, 0, 12), (8, 12), seed=2,  # the boundary between sequences, an empty one on it: no exchange
         options={"lower_bound": -3.0, "use_gate_in_kernel": True}),
    Case("kda", (7, 9, 5), (10, 11), dtype=torch.float32, state_v_first=True, seed=3, options=KDA_GATE),
    Case("kda", (0, 12, 0), (5, 7), seed=7, options=KDA_GATE),  # empty sequences first and last
]
KDA_3 = [
    Case("kda", (25,), (7, 11, 7), options={**KDA_GATE, "chunk_size": 16}),  # one sequence over 3 ranks
    Case("kda", (2, 24, 4), (9, 10, 11), seed=4),  # packed: one sequence crossing 2 boundaries
    Case("kda", (4, 10, 0, 7, 9), (8, 12, 10), seed=5, output_final_state=False, options=KDA_GATE),
    Case("kda", (4, 10, 0, 7, 9), (8, 12, 10), seed=6, initial_state=False),  # a rank both receives and sends
]


def _as_gdn(case: Case) -> Case:
    """The same layout on GDN: no lower-bound gate there; negative eigenvalues with the beta sigmoid."""
    options = {name: value for name, value in case.options.items() if name not in ("lower_bound", "safe_gate")}
    if options.get("use_beta_sigmoid_in_kernel"):
        options["allow_neg_eigval"] = True
    return replace(case, rule="gdn", options=options)


GDN_2, GDN_3 = [_as_gdn(c) for c in KDA_2], [_as_gdn(c) for c in KDA_3]


def _offsets(seq_lengths) -> list[int]:
    out = [0]
    for n in seq_lengths:
        out.append(out[-1] + n)
    return out


def _global_inputs(case: Case, device) -> dict:
    """Every tensor of the call over all packed tokens (the same on every rank), plus loss weights."""
    gen = torch.Generator().manual_seed(case.seed)
    T, N = sum(case.seq_lengths), len(case.seq_lengths)
    H, HV, K, V = case.dims
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    gate_in_kernel = case.options.get("use_gate_in_kernel", False)
    gate_shape = (1, T, HV, K) if case.rule == "kda" else (1, T, HV)
    k = r(1, T, H, K)
    if not case.options.get("use_qk_l2norm_in_kernel", False):
        k = k / k.norm(dim=-1, keepdim=True)  # unit keys: the state stays bounded without the in-kernel norm
    g = r(*gate_shape) if gate_in_kernel else -0.3 * F.softplus(r(*gate_shape))
    beta = r(1, T, HV) if case.options.get("use_beta_sigmoid_in_kernel", False) else torch.rand(
        1, T, HV, generator=gen, dtype=torch.float64)
    state_shape = (N, HV, V, K) if case.state_v_first else (N, HV, K, V)
    x = {"q": r(1, T, H, K), "k": k, "v": r(1, T, HV, V), "g": g, "beta": beta}
    if gate_in_kernel:
        x["A_log"] = 0.5 * r(HV)
        x["dt_bias"] = r(HV * K if case.rule == "kda" else HV)
    if case.initial_state:
        x["initial_state"] = r(*state_shape)
    state_dtype = torch.float64 if case.dtype == torch.float64 else torch.float32
    x = {n: t.to(device, state_dtype if n in ("initial_state", "A_log", "dt_bias") else case.dtype)
         for n, t in x.items()}
    weights = {"o": r(1, T, HV, V).to(device), "final": r(*state_shape).to(device)}
    return {"inputs": x, "weights": weights}


def _call(case: Case, inputs: dict, **kwargs):
    fn = chunk_kda if case.rule == "kda" else chunk_gated_delta_rule
    return fn(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
              initial_state=inputs.get("initial_state"), A_log=inputs.get("A_log"), dt_bias=inputs.get("dt_bias"),
              state_v_first=case.state_v_first, **case.options, **kwargs)


def _leaves(inputs: dict) -> dict:
    return {n: t.detach().clone().requires_grad_() for n, t in inputs.items()}


def _one_process(case: Case, data: dict, cu: torch.Tensor):
    x = _leaves(data["inputs"])
    o, final = _call(case, x, output_final_state=True, cu_seqlens=cu)
    loss = (o * data["weights"]["o"]).sum()
    if case.output_final_state:
        loss = loss + (final * data["weights"]["final"]).sum()
    grads = dict(zip(x, torch.autograd.grad(loss, list(x.values()))))
    return o.detach(), final.detach(), grads


def _state_after(case: Case, data: dict, offsets: list[int], end: int, seq: int) -> torch.Tensor:
    """The one-process state of global sequence ``seq`` after token ``end`` (a run of the prefix)."""
    prefix = {n: (t[:, :end] if t.dim() >= 3 and n != "initial_state" else t) for n, t in data["inputs"].items()}
    if "initial_state" in prefix:
        prefix["initial_state"] = prefix["initial_state"][:seq + 1]
    cu = torch.tensor(offsets[:seq + 1] + [end], device=prefix["q"].device)
    with torch.no_grad():
        return _call(case, prefix, output_final_state=True, cu_seqlens=cu)[1][seq]


def _check(name: str, actual, expected, tol: float, rank: int, case: Case) -> None:
    err = rel_error(actual, expected, floor=1e-30)
    if os.environ.get("KDA_TEST_REPORT_ERRORS") == "1":
        print(f"rank {rank} {case.rule} {case.seq_lengths} {case.slice_lengths} {case.dtype}: {name} {err:.2e}")
    if not err <= tol:  # NaN fails
        raise AssertionError(f"rank {rank}, {case}: {name} relative error {err:.3g} > {tol:g}")


def _check_case(rank: int, world_size: int, case: Case, device: str) -> None:
    offsets = _offsets(case.seq_lengths)
    cu = torch.tensor(offsets, device=device)
    data = _global_inputs(case, device)
    o_full, final_full, grads_full = _one_process(case, data, cu)

    ctx = build_cp_context(cu, dist.group.WORLD, slice_lengths=case.slice_lengths)
    rows, first, n = slice(ctx.start, ctx.start + ctx.local_length), ctx.first_seq_index, ctx.num_seqs
    local = {name: (t[:, rows] if t.dim() >= 3 and name != "initial_state" else t)
             for name, t in data["inputs"].items()}
    if "initial_state" in local:
        local["initial_state"] = local["initial_state"][first:first + n]
    x = _leaves(local)
    o, final = _call(case, x, output_final_state=case.output_final_state, cp_context=ctx)
    ending = range(n - 1) if not ctx.is_last_rank else range(n)  # local sequences whose end is on this rank
    loss = (o * data["weights"]["o"][:, rows]).sum()
    if case.output_final_state:
        loss = loss + sum((final[i] * data["weights"]["final"][first + i]).sum() for i in ending)
    grads = dict(zip(x, torch.autograd.grad(loss, list(x.values()), allow_unused=True)))

    tol = case.tol if case.tol is not None else TOL[case.dtype]
    _check("o", o, o_full[:, rows], tol, rank, case)
    with torch.no_grad():  # inference: no autograd graph, the same collective
        o_inference = _call(case, local, output_final_state=case.output_final_state, cp_context=ctx)[0]
    _check("o without grad", o_inference, o_full[:, rows], tol, rank, case)
    with torch.inference_mode():  # no autograd dispatch key at all (torch 2.11's differentiable gather has only that)
        o_inference = _call(case, local, output_final_state=case.output_final_state, cp_context=ctx)[0]
    _check("o in inference mode", o_inference, o_full[:, rows], tol, rank, case)
    if case.output_final_state:
        for i in ending:
            _check(f"final_state[{i}]", final[i], final_full[first + i], tol, rank, case)
        if not ctx.is_last_rank:
            passed_on = _state_after(case, data, offsets, ctx.start + ctx.local_length, first + n - 1)
            _check("final_state passed on", final[n - 1], passed_on, tol, rank, case)
    else:
        assert final is None
    for name, grad in grads.items():
        expected = grads_full[name]
        if name in ("A_log", "dt_bias"):  # shared parameters: each rank holds its tokens' share
            grad = grad.clone()
            dist.all_reduce(grad)
        elif name == "initial_state":
            expected = expected[first:first + n].clone()
            if not ctx.is_first_rank:  # local sequence 0 took its state from an earlier rank
                expected[0] = 0
            if grad is None and n == 1 and not ctx.is_first_rank:  # its only entry was not read
                grad = torch.zeros_like(expected)
        else:
            expected = expected[:, rows]
        _check(f"d{name}", grad, expected, tol, rank, case)


def _check_cases(rank: int, world_size: int, cases: list, device_type: str) -> None:
    device = f"cuda:{rank}" if device_type == "cuda" else "cpu"
    for case in cases:
        _check_case(rank, world_size, case, device)


@pytest.mark.parametrize("world_size, cases", [(2, KDA_2), (3, KDA_3)], ids=["2-ranks", "3-ranks"])
def test_kda_matches_one_process(world_size, cases):
    run_in_processes(_check_cases, world_size, cases, "cpu")


@pytest.mark.parametrize("world_size, cases", [(2, GDN_2), (3, GDN_3)], ids=["2-ranks", "3-ranks"])
def test_gdn_matches_one_process(world_size, cases):
    run_in_processes(_check_cases, world_size, cases, "cpu")


GPU_DIMS = (2, 4, 64, 64)
CUDA_CASES = [
    Case("kda", (2048,), (1024, 1024), dtype=torch.bfloat16, dims=GPU_DIMS, options=KDA_GATE),
    Case("kda", (300, 0, 1000, 700, 48), (1024, 1024), dtype=torch.bfloat16, dims=GPU_DIMS, seed=1,
         options={**KDA_GATE, "lower_bound": -5.0, "safe_gate": True}),
    Case("kda", (300, 0, 1000, 700, 48), (1024, 1024), dtype=torch.float32, dims=GPU_DIMS, seed=2,
         options=KDA_GATE),
]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(), reason="needs 2 GPUs and NCCL")
@pytest.mark.parametrize("rule", ["kda", "gdn"])
def test_matches_one_process_on_two_gpus(rule):
    cases = [replace(c, tol=TOL_CUDA[c.dtype]) for c in CUDA_CASES]
    cases = cases if rule == "kda" else [_as_gdn(c) for c in cases]
    run_in_processes(_check_cases, 2, cases, "cuda", backend="nccl", timeout_s=300)


def _check_compiled(rank: int, world_size: int, case: Case) -> None:
    """The call under torch.compile(fullgraph=True) (aot_eager: no C++ build) equals the eager call."""
    cu = torch.tensor(_offsets(case.seq_lengths))
    data = _global_inputs(case, "cpu")
    ctx = build_cp_context(cu, dist.group.WORLD, slice_lengths=case.slice_lengths)
    rows = slice(ctx.start, ctx.start + ctx.local_length)
    local = {name: (t[:, rows] if t.dim() >= 3 and name != "initial_state" else t)
             for name, t in data["inputs"].items()}
    local["initial_state"] = local["initial_state"][ctx.first_seq_index:ctx.first_seq_index + ctx.num_seqs]

    def loss(x):
        o, final = _call(case, x, output_final_state=True, cp_context=ctx)
        return (o * data["weights"]["o"][:, rows]).sum() + final.sum()

    results = []
    for fn in (loss, torch.compile(loss, backend="aot_eager", fullgraph=True)):
        x = _leaves(local)
        value = fn(x)
        results.append((value.detach(), torch.autograd.grad(value, list(x.values()), allow_unused=True)))
    (eager, eager_grads), (compiled, compiled_grads) = results
    _check("compiled loss", compiled, eager, 1e-12, rank, case)
    for name, a, b in zip(local, compiled_grads, eager_grads):
        if b is not None:
            _check(f"compiled d{name}", a, b, 1e-12, rank, case)


def test_compiles_without_graph_break():
    run_in_processes(_check_compiled, 2, KDA_2[1])
