"""What the DTensor tests check in each process: an op call on DTensors against the same call on the full
tensors in one process (outputs and gradients, eager and compiled), that nothing was communicated, and
what the compiled graphs hold.

A :class:`Case` is a function of named tensors (the op call, returning a tuple of tensors) with the full
inputs and the placement of each on a 1-D mesh. :func:`check_case` runs it on plain tensors (the one-process
result), then on DTensors eagerly under ``CommDebugMode`` and through ``torch.compile(fullgraph=True)`` with
an AOTAutograd backend that keeps the forward / backward graphs, and compares.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from kda_compile.testing import rel_error

COLLECTIVES = ("_c10d_functional", "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast")

# Where the multi-process tests run: 2 CPU processes over gloo (float64: the reference math), and 2 GPUs over
# NCCL (float32: our Triton / CUDA kernels and FLA's, whose residuals the sharding rules place too).
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")])]
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
DTYPES = {"cpu": torch.float64, "cuda": torch.float32}
TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-5}  # same per-head math; fp32 kernels may reorder sums


@dataclass
class Case:
    """``run(tensors) -> tuple of output tensors``; ``inputs``: name -> full tensor; ``placements``: name ->
    placement on the mesh; ``grad``: whether to differentiate (the sum of every floating output)."""

    name: str
    run: Callable[[dict], tuple]
    inputs: dict
    placements: dict
    grad: bool = True
    expect_comms: bool = False  # the op's rule gathers these inputs (checked to happen, and to be right)
    tol: float = 1e-10
    output_placements: tuple | None = None  # expected placements of the outputs (None: not checked)
    ops: tuple = field(default_factory=tuple)  # op names the compiled forward graph must hold


class AotCapture:
    """An ``aot_eager``-like backend that keeps the code of every forward / backward graph AOTAutograd made
    (after DTensor desugaring: a redistribution shows there as a functional collective)."""

    def __init__(self) -> None:
        self.codes: list[str] = []
        self.backend = aot_autograd(fw_compiler=self._keep, bw_compiler=self._keep)

    def _keep(self, gm: torch.fx.GraphModule, example_inputs):
        self.codes.append(gm.code)
        return make_boxed_func(gm.forward)

    def collectives(self) -> list[str]:
        return [line.strip() for code in self.codes for line in code.splitlines()
                if any(c in line for c in COLLECTIVES)]


def objective(outputs) -> torch.Tensor:
    """A weighted sum of every floating output (one weight per output: no gradient cancels). On DTensors, the
    sum of this rank's shard: its gradient is the global sum's gradient, with no communication."""
    total = 0
    for i, out in enumerate(outputs):
        if out is not None and out.is_floating_point():
            total = total + (i + 1) * (out.to_local() if isinstance(out, DTensor) else out).sum()
    return total


def _one_process(case: Case, device: str) -> tuple[tuple, dict]:
    leaves = {n: t.detach().to(device).clone().requires_grad_(case.grad and t.is_floating_point())
              for n, t in case.inputs.items()}
    outputs = case.run(leaves)
    grads = {}
    if case.grad:
        objective(outputs).backward()
        grads = {n: t.grad for n, t in leaves.items() if t.grad is not None}
    return tuple(o.detach() if o is not None else None for o in outputs), grads


def _distributed(case: Case, mesh) -> dict:
    return {n: distribute_tensor(t.detach().to(mesh.device_type), mesh, [case.placements[n]]).requires_grad_(
        case.grad and t.is_floating_point()) for n, t in case.inputs.items()}


def _compare(case: Case, how: str, outputs, leaves, expected_out, expected_grads) -> None:
    for i, (got, want) in enumerate(zip(outputs, expected_out)):
        if want is None:
            continue
        assert isinstance(got, DTensor), f"{case.name} ({how}): output {i} is not a DTensor: {type(got)}"
        if case.output_placements is not None:
            assert tuple(got.placements) == (case.output_placements[i],), (case.name, how, i, got.placements)
        full = got.full_tensor()
        assert full.shape == want.shape, (case.name, how, i, full.shape, want.shape)
        if want.is_floating_point():
            err = rel_error(full, want)
            assert err <= case.tol, f"{case.name} ({how}): output {i} relative error {err}"
        else:
            assert torch.equal(full, want), f"{case.name} ({how}): output {i} differs"
    for name, want in expected_grads.items():
        got = leaves[name].grad
        assert got is not None, f"{case.name} ({how}): no gradient reached {name}"
        err = rel_error(got.full_tensor(), want)
        assert err <= case.tol, f"{case.name} ({how}): gradient of {name} relative error {err}"


def check_case(case: Case, mesh) -> None:
    """The DTensor call equals the one-process call, eagerly and compiled, with no communication unless
    ``case.expect_comms``; the compiled forward graph holds ``case.ops``."""
    expected_out, expected_grads = _one_process(case, mesh.device_type)

    leaves = _distributed(case, mesh)
    with CommDebugMode() as comms:
        outputs = case.run(leaves)
        if case.grad:
            objective(outputs).backward()
    counts = {str(k): v for k, v in comms.get_comm_counts().items()}
    if case.expect_comms:
        assert counts, f"{case.name}: expected the rule to gather its inputs, nothing was communicated"
    else:
        assert not counts, f"{case.name}: communication on head-sharded inputs: {counts}"
    _compare(case, "eager", outputs, leaves, expected_out, expected_grads)

    torch._dynamo.reset()
    capture = AotCapture()
    compiled = torch.compile(case.run, backend=capture.backend, fullgraph=True)
    leaves = _distributed(case, mesh)
    outputs = compiled(leaves)
    if case.grad:
        objective(outputs).backward()
    _compare(case, "compiled", outputs, leaves, expected_out, expected_grads)
    if not case.expect_comms:
        assert not capture.collectives(), f"{case.name}: collectives in the compiled graphs: {capture.collectives()}"
    forward_code = capture.codes[0]
    for op in case.ops:
        assert f"kda_compile.{op}" in forward_code, f"{case.name}: {op} not in the compiled graph:\n{forward_code}"
