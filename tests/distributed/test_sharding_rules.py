"""Every ``torch.ops.kda_compile`` op on DTensors (ops/*/sharding.py, docs/distributed.md): the delta rules.

On a 2-rank mesh (CPU over gloo in float64; 2 GPUs over NCCL in float32, marked ``cuda``), each KDA / GDN op
called through its public function with inputs sharded on their heads (grouped value heads with their q / k
heads, A_log / dt_bias / states on their head dims) gives the one-process result, outputs and gradients, to a
relative error of 1e-10 (float64) / 1e-5 (float32): the same per-head math runs on each rank. Eagerly nothing is
communicated (``CommDebugMode``); under ``torch.compile(fullgraph=True)`` the forward and backward graphs hold
the op and no collective. A call asking for the final state after one that did not gets the state's metadata
(the flags key DTensor's cache); a bad argument met while compiling raises our error on DTensors too. One
process checks that every op has a rule, how the cache is keyed, and that without torch.distributed the
package imports and logs why no rule was registered.
"""
from __future__ import annotations

import pytest
import torch

from distributed.dtensor_checks import BACKENDS, DEVICES
from distributed.spawn import run_in_processes

pytest.importorskip("torch.distributed.tensor.experimental")


def _generator():
    return torch.Generator().manual_seed(0)


def _rand(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


# ------------------------------------------------------------------------------------------------------------
# One process
# ------------------------------------------------------------------------------------------------------------
def test_every_op_has_a_sharding_rule():
    from kda_compile.ops._sharding import sharding_rules_status

    registered, why = sharding_rules_status()
    assert why is None, why
    ops = {name for name in dir(torch.ops.kda_compile) if not name.startswith("_") and name != "name"}
    ops = {name for name in ops if isinstance(getattr(torch.ops.kda_compile, name), torch._ops.OpOverloadPacket)}
    assert ops == set(registered), sorted(ops ^ set(registered))


def test_every_flag_keys_the_sharding_cache():
    """register_sharding alone keys DTensor's cache on the arguments from the first int onwards; a KDA call
    asking for its final state after one that did not would then reuse the empty state's shape."""
    from torch.distributed.tensor import DTensor

    info = DTensor._op_dispatcher.sharding_propagator.op_to_schema_info
    op = torch.ops.kda_compile.chunk_kda_fwd.default
    first_flag = [a.name for a in op._schema.arguments].index("scale")
    assert info[op].static_argnum == first_flag
    assert "output_final_state" in info[op].static_kwargkey


def test_without_torch_distributed_the_ops_import_and_the_reason_is_logged():
    """A torch without torch.distributed: kda_compile imports, registers no rule, says why (INFO)."""
    import subprocess
    import sys

    code = """
import logging, torch
logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
torch.distributed.is_available = lambda: False
import kda_compile
from kda_compile.ops import chunk_kda
from kda_compile.ops._sharding import sharding_rules_status
print(sharding_rules_status())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "({}, 'this torch build has no torch.distributed')", done.stdout
    assert ("kda_compile.ops.sharding INFO DTensor sharding rules of the kda_compile ops not registered: this torch "
            "build has no torch.distributed") in done.stderr, done.stderr[-3000:]


# ------------------------------------------------------------------------------------------------------------
# Two processes
# ------------------------------------------------------------------------------------------------------------
def _delta_rule_cases(dtype: torch.dtype):
    from torch.distributed.tensor import Shard

    from distributed.dtensor_checks import TOLERANCES, Case
    from kda_compile.ops import chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule, fused_recurrent_kda

    gen = _generator()
    rand = lambda *shape: _rand(gen, *shape, dtype=dtype)  # noqa: E731
    B, T, H, HV, K, V = 2, 9, 2, 4, 16, 16  # grouped value heads: each q / k head serves two value heads
    dims = {"q": 2, "k": 2, "v": 2, "g": 2, "beta": 2, "A_log": 0, "dt_bias": 0, "h0": 1}
    placements = {name: Shard(dim) for name, dim in dims.items()}
    common = {"q": rand(B, T, H, K), "k": rand(B, T, H, K), "v": rand(B, T, HV, V), "beta": rand(B, T, HV),
              "A_log": rand(HV), "h0": rand(B, HV, K, V)}
    kda = {**common, "g": rand(B, T, HV, K), "dt_bias": rand(HV * K)}
    gdn = {**common, "g": rand(B, T, HV), "dt_bias": rand(HV)}
    tol = TOLERANCES[dtype]
    gate = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    state_out = (Shard(2), Shard(1))

    def kda_chunk(t):
        return chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["h0"], output_final_state=True,
                         A_log=t["A_log"], dt_bias=t["dt_bias"], **gate)

    def kda_decode(t):
        return fused_recurrent_kda(t["q"][:, :1], t["k"][:, :1], t["v"][:, :1], t["g"][:, :1], t["beta"][:, :1],
                                   t["A_log"], t["dt_bias"], initial_state=t["h0"], output_final_state=True, **gate)

    def kda_decode_in_place(t):
        o, state = fused_recurrent_kda(t["q"][:, :1], t["k"][:, :1], t["v"][:, :1], t["g"][:, :1], t["beta"][:, :1],
                                       t["A_log"], t["dt_bias"], initial_state=t["h0"], output_final_state=True,
                                       inplace_final_state=True, **gate)
        assert state is t["h0"]
        return o, state

    def gdn_decode_in_place(t):
        o, state = fused_recurrent_gated_delta_rule(
            t["q"][:, :1], t["k"][:, :1], t["v"][:, :1], t["g"][:, :1], beta=t["beta"][:, :1], initial_state=t["h0"],
            output_final_state=True, A_log=t["A_log"], dt_bias=t["dt_bias"], inplace_final_state=True, **gate)
        return o, state

    def gdn_chunk(t):
        return chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["h0"],
                                      output_final_state=True, A_log=t["A_log"], dt_bias=t["dt_bias"], **gate)

    def gdn_decode(t):
        return fused_recurrent_gated_delta_rule(t["q"][:, :1], t["k"][:, :1], t["v"][:, :1], t["g"][:, :1],
                                                beta=t["beta"][:, :1], initial_state=t["h0"], output_final_state=True,
                                                A_log=t["A_log"], dt_bias=t["dt_bias"], **gate)

    return [
        Case("chunk_kda", kda_chunk, kda, placements, output_placements=state_out, ops=("chunk_kda_fwd",), tol=tol),
        Case("fused_recurrent_kda", kda_decode, kda, placements, grad=False, output_placements=state_out,
             ops=("fused_recurrent_kda_fwd",), tol=tol),
        Case("chunk_gated_delta_rule", gdn_chunk, gdn, placements, output_placements=state_out,
             ops=("chunk_gdn_fwd",), tol=tol),
        Case("fused_recurrent_gated_delta_rule", gdn_decode, gdn, placements, grad=False, output_placements=state_out,
             ops=("fused_recurrent_gdn_fwd",), tol=tol),
        Case("fused_recurrent_kda in place", kda_decode_in_place, kda, placements, grad=False,
             output_placements=state_out, ops=("fused_recurrent_kda_inplace",), tol=tol),
        Case("fused_recurrent_gated_delta_rule in place", gdn_decode_in_place, gdn, placements, grad=False,
             output_placements=state_out, ops=("fused_recurrent_gdn_inplace",), tol=tol),
    ]


def delta_rule_worker(rank: int, world_size: int, device: str) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from distributed.dtensor_checks import DTYPES, check_case
    from kda_compile.ops import chunk_kda

    mesh = init_device_mesh(device, (world_size,))
    for case in _delta_rule_cases(DTYPES[device]):
        check_case(case, mesh)
    # a call without the final state, then one with it, on the same inputs: the second must not reuse the
    # first's (empty) state metadata
    gen = _generator()
    q, k, v, g = (distribute_tensor(_rand(gen, 1, 4, 2, 8).to(device), mesh, [Shard(2)]) for _ in range(4))
    beta = distribute_tensor(torch.rand(1, 4, 2, dtype=torch.float64, generator=gen).to(device), mesh, [Shard(2)])
    with torch.no_grad():
        assert chunk_kda(q, k, v, g, beta, output_final_state=False)[1] is None
        _, state = chunk_kda(q, k, v, g, beta, output_final_state=True)
    assert state.shape == (1, 2, 8, 8) and state.placements == (Shard(1),), (state.shape, state.placements)
    # a bad argument met while compiling: the deferred error op runs on DTensors and raises our error
    bad = torch.compile(lambda *t: chunk_kda(*t, scale=float("nan")), backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match="scale must be a finite .*got nan"):
        bad(q, k, v, g, beta)


@pytest.mark.parametrize("device", DEVICES)
def test_delta_rule_ops_on_head_sharded_dtensors(device):
    run_in_processes(delta_rule_worker, 2, device, backend=BACKENDS[device], timeout_s=120)
