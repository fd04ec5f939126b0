"""``build_cp_context`` / ``plan_slice`` (docs/context-parallel.md): where each rank's slice lies, and the
errors for contexts and calls that cannot be right."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kda_compile.ops import build_cp_context, chunk_gated_delta_rule, chunk_kda
from kda_compile.ops.context_parallel import plan_slice

from .spawn import run_in_processes


@pytest.mark.parametrize("offsets, lengths, rank, expected", [
    # one sequence over 3 ranks: the middle rank receives and passes on
    ([0, 25], [7, 11, 7], 1, dict(start=7, offsets=(0, 11), first_seq_index=0, pre_num_ranks=1, post_num_ranks=1,
                                  pre_num_conv_tokens=7, crossings=(True, True))),
    ([0, 25], [7, 11, 7], 2, dict(offsets=(0, 7), pre_num_ranks=2, post_num_ranks=0, pre_num_conv_tokens=18)),
    # packed, uneven: sequence 2 crosses the boundary at 11; the empty sequence 1 stays on rank 0
    ([0, 5, 5, 14, 20, 23], [11, 12], 0, dict(offsets=(0, 5, 5, 11), first_seq_index=0, pre_num_ranks=0,
                                              post_num_ranks=1, crossings=(True,))),
    ([0, 5, 5, 14, 20, 23], [11, 12], 1, dict(start=11, offsets=(0, 3, 9, 12), first_seq_index=2, pre_num_ranks=1,
                                              post_num_ranks=0, pre_num_conv_tokens=6)),
    # a boundary between sequences: nothing crosses; an empty sequence there belongs to the later rank
    ([0, 10, 10, 20], [10, 10], 0, dict(offsets=(0, 10), first_seq_index=0, post_num_ranks=0, crossings=(False,))),
    ([0, 10, 10, 20], [10, 10], 1, dict(offsets=(0, 0, 10), first_seq_index=1, pre_num_ranks=0)),
    # an empty sequence at the very end belongs to the last rank
    ([0, 20, 20], [10, 10], 1, dict(offsets=(0, 10, 10), first_seq_index=0, pre_num_ranks=1)),
])
def test_plan_slice(offsets, lengths, rank, expected):
    plan = plan_slice(offsets, lengths, rank)
    assert {name: getattr(plan, name) for name in expected} == expected


def _check_errors(rank: int, world_size: int) -> None:
    group, cu = dist.group.WORLD, torch.tensor([0, 7, 20])
    bad_builds = [
        (dict(slice_lengths=[5, 5, 10]), ValueError,
         r"slice_lengths must be one length per rank of the group \(2 ranks\), got \[5, 5, 10\]"),
        (dict(slice_lengths=[10, 9]), ValueError,
         r"slice_lengths must be lengths summing to cu_seqlens\[-1\] = 20, the packed tokens of all ranks, "
         r"got \[10, 9\] \(sum 19\)"),
        (dict(slice_lengths=[0, 20]), ValueError, r"slice_lengths must be positive ints"),
        (dict(layout="zigzag"), ValueError, r"layout must be 'contiguous'"),
        (dict(use_tf32x3_affine_chain=False), ValueError, r"use_tf32x3_affine_chain must be True"),
    ]
    for kwargs, kind, match in bad_builds:
        with pytest.raises(kind, match=match):
            build_cp_context(cu, group, **kwargs)
    with pytest.raises(ValueError, match=r"cu_seqlens must be a positive multiple of the group size 2 for equal "
                                         r"slices; pass slice_lengths=\[...\]"):
        build_cp_context(torch.tensor([0, 21]), group)
    with pytest.raises(ValueError, match=r"cu_seqlens must be offsets starting at 0, got \[1, 20\]"):
        build_cp_context(torch.tensor([1, 20]), group)
    with pytest.raises(TypeError, match=r"group must be a torch.distributed ProcessGroup"):
        build_cp_context(cu, None)

    ctx = build_cp_context(cu, group)  # slices [10, 10]: rank 0 holds sequence 0 and 3 tokens of sequence 1
    H, HV, K, V = 1, 2, 4, 4
    args = [torch.randn(1, 10, H, K), torch.randn(1, 10, H, K), torch.randn(1, 10, HV, V),
            -torch.rand(1, 10, HV, K), torch.rand(1, 10, HV)]
    with pytest.raises(ValueError, match=r"q must be this rank's slice of the packed tokens, \[1, T, H, K\] with "
                                         r"T = 10 \(cp_context.slice_lengths\[" + str(rank) + r"\]\)"):
        chunk_kda(torch.randn(1, 11, H, K), *args[1:], cp_context=ctx)
    with pytest.raises(ValueError, match=r"cu_seqlens must be None or cp_context.cu_seqlens when cp_context is given"):
        chunk_kda(*args, cu_seqlens=cu, cp_context=ctx)
    with pytest.raises(TypeError, match=r"cp_context must be None or a kda_compile.ops.CPContext"):
        chunk_kda(*args, cp_context=object())
    with pytest.raises(TypeError, match=r"cp_context must be None or a kda_compile.ops.CPContext"):
        chunk_gated_delta_rule(*args[:3], args[3][..., 0], args[4], cp_context=object())
    local_n = ctx.num_seqs  # 2 on rank 0 (sequence 0 and the start of 1), 1 on rank 1
    with pytest.raises(ValueError, match=rf"initial_state must be of shape \[N, HV, K, V\] = \[{local_n}, 2, 4, 4\]"):
        chunk_kda(*args, initial_state=torch.zeros(3, HV, K, V), cp_context=ctx)


def test_invalid_contexts_and_calls():
    run_in_processes(_check_errors, 2)
