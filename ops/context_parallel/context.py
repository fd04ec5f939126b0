"""Where each rank's slice of a packed batch lies: ``build_cp_context`` and the ``CPContext`` it returns.

Context parallelism splits the packed tokens of ``cu_seqlens`` (one long sequence, or many sequences packed
along T) into contiguous slices, one per rank of a process group, in rank order. Everything here is host
arithmetic on the offsets, done once per batch; the chunked ops read the result (docs/context-parallel.md).

The names follow flash-linear-attention's ``fla.ops.cp`` (``build_cp_context(cu_seqlens, group, ...)``,
``cu_seqlens`` / ``cu_seqlens_cpu`` of this rank, ``pre_num_ranks``, ``is_first_rank`` ...), so code written
for FLA's contiguous layout switches by changing the import. Beyond FLA: uneven slices (``slice_lengths``),
and the global index of each local sequence (``first_seq_index``) for initial and final states.
"""
from __future__ import annotations

import bisect
import itertools
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from kda_compile.ops._common import arg_error, check_tensor, describe

logger = logging.getLogger("kda_compile.ops.context_parallel")


@dataclass(frozen=True)
class SlicePlan:
    """One rank's slice of the packed tokens, from the global offsets alone (no process group needed).

    ``offsets``: this rank's ``cu_seqlens`` (local sequences: every sequence with a token in the slice, cut to
    it, plus the empty sequences placed here: an empty sequence at offset ``p`` belongs to the rank whose slice
    holds token ``p``, the last rank when ``p`` is the total). ``first_seq_index``: the global index of local
    sequence 0. ``pre_num_ranks``: how many earlier ranks hold tokens of local sequence 0 (0: it starts here).
    ``post_num_ranks``: how many later ranks hold tokens of the last local sequence (0: it ends here).
    ``crossings[b]``: whether a sequence runs across the boundary between ranks ``b`` and ``b + 1``.
    """
    rank: int
    start: int
    offsets: tuple[int, ...]
    first_seq_index: int
    pre_num_ranks: int
    post_num_ranks: int
    pre_num_conv_tokens: int
    crossings: tuple[bool, ...]


def plan_slice(offsets: Sequence[int], slice_lengths: Sequence[int], rank: int) -> SlicePlan:
    """The ``SlicePlan`` of ``rank`` for global offsets ``offsets`` split into ``slice_lengths`` (checked
    already: valid offsets, positive lengths summing to ``offsets[-1]``)."""
    starts = [0, *itertools.accumulate(slice_lengths)]
    total, start, end = starts[-1], starts[rank], starts[rank + 1]
    owner = lambda token: bisect.bisect_right(starts, token) - 1  # noqa: E731  (rank holding a token)
    local = [i for i in range(len(offsets) - 1) if _on_rank(offsets[i], offsets[i + 1], start, end, total)]
    first, last = local[0], local[-1]
    cut = [min(max(offsets[i], start), end) - start for i in local] + [min(offsets[last + 1], end) - start]
    first_start, last_end = offsets[first], offsets[last + 1]
    boundaries = set(offsets)  # a rank boundary inside [0, total) is inside a sequence unless it is an offset
    crossings = tuple(b not in boundaries for b in starts[1:-1])
    return SlicePlan(
        rank=rank, start=start, offsets=tuple(cut), first_seq_index=first,
        pre_num_ranks=rank - owner(first_start) if first_start < start else 0,
        post_num_ranks=owner(last_end - 1) - rank if last_end > end else 0,
        pre_num_conv_tokens=max(0, start - first_start), crossings=crossings)


def _on_rank(seq_start: int, seq_end: int, start: int, end: int, total: int) -> bool:
    if seq_start == seq_end:  # empty: owned by the rank holding token seq_start (the last rank at the end)
        return start <= seq_start < end or (seq_start == total and end == total)
    return seq_start < end and seq_end > start


@dataclass(frozen=True)
class CPContext:
    """This rank's part of a context-parallel call (built by :func:`build_cp_context`; pass it as
    ``cp_context`` to ``chunk_kda`` / ``chunk_gated_delta_rule`` with this rank's slice of q, k, v, g, beta).

    Fields shared with FLA's ``FLACPContext`` (contiguous layout): ``group``, ``cu_seqlens`` (this rank's
    offsets, on the device of the global ``cu_seqlens``), ``cu_seqlens_cpu`` (their host copy),
    ``pre_num_ranks`` / ``is_first_rank`` (earlier ranks holding tokens of local sequence 0; first: none),
    ``post_num_ranks`` / ``is_last_rank`` (later ranks holding tokens of the last local sequence),
    ``conv1d_kernel_size``, ``pre_num_conv_tokens`` (tokens of local sequence 0 before this slice), ``layout``.
    Ours: ``rank`` / ``world_size`` in ``group``; ``slice_lengths`` (tokens per rank); ``start`` (global index
    of this rank's first token); ``first_seq_index`` (local sequence ``i`` is global sequence
    ``first_seq_index + i``); ``crossings`` (per rank boundary, whether a sequence runs across it);
    ``local_offsets`` (``cu_seqlens_cpu`` as Python ints: constants under torch.compile).
    """
    group: dist.ProcessGroup
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    rank: int
    world_size: int
    slice_lengths: tuple[int, ...]
    start: int
    first_seq_index: int
    pre_num_ranks: int
    post_num_ranks: int
    crossings: tuple[bool, ...]
    local_offsets: tuple[int, ...] = ()
    conv1d_kernel_size: Optional[int] = None
    pre_num_conv_tokens: int = 0
    layout: str = "contiguous"

    @property
    def is_first_rank(self) -> bool:
        """Local sequence 0 starts on this rank (no state comes from an earlier rank)."""
        return self.pre_num_ranks == 0

    @property
    def is_last_rank(self) -> bool:
        """The last local sequence ends on this rank (its state goes to no later rank)."""
        return self.post_num_ranks == 0

    @property
    def num_seqs(self) -> int:
        """Number of local sequences (the ``N`` of this rank's initial and final states)."""
        return len(self.local_offsets) - 1

    @property
    def local_length(self) -> int:
        """Tokens of this rank's slice (T of its q, k, v, g, beta)."""
        return self.slice_lengths[self.rank]

    @property
    def is_cp_enabled(self) -> bool:
        return True


def build_cp_context(
    cu_seqlens: torch.Tensor,
    group: dist.ProcessGroup,
    conv1d_kernel_size: Optional[int] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    use_tf32x3_affine_chain: bool = True,
    layout: str = "contiguous",
    *,
    slice_lengths: Optional[Sequence[int]] = None,
) -> CPContext:
    """This rank's ``CPContext`` for the packed batch ``cu_seqlens``, split along T over ``group``.

    Args:
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of ALL sequences before the split (the same on every rank);
            one sequence of T tokens is ``[0, T]``. Its values are read on the host (once, here).
        group: the process group of the split; rank ``r`` of the group holds slice ``r``.
        conv1d_kernel_size: recorded for FLA compatibility (a causal conv before the op needs
            ``pre_num_conv_tokens``); not used by the delta-rule ops.
        cu_seqlens_cpu: a host copy of ``cu_seqlens`` (saves a device-to-host copy).
        use_tf32x3_affine_chain: accepted for FLA compatibility; must be True (the state chain runs in
            float64, docs/context-parallel.md).
        layout: ``"contiguous"`` (FLA's ``"zigzag"`` is not supported).
        slice_lengths: tokens per rank (positive, one per rank of ``group``, summing to ``cu_seqlens[-1]``).
            Default: equal slices, which needs ``cu_seqlens[-1]`` divisible by the group size (FLA's rule).
    Returns:
        The context of the calling rank. Every rank of ``group`` must build it from the same ``cu_seqlens`` and
        ``slice_lengths`` (nothing is exchanged here).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_cp_context needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group)")
    if not isinstance(group, dist.ProcessGroup):
        raise arg_error("group", describe(group), "a torch.distributed ProcessGroup (the ranks of the split)",
                        kind=TypeError)
    if layout != "contiguous":
        raise arg_error("layout", repr(layout), "'contiguous' (one slice per rank in rank order)")
    if use_tf32x3_affine_chain is not True:
        raise arg_error("use_tf32x3_affine_chain", use_tf32x3_affine_chain, "True (accepted for FLA compatibility; "
                        "the state chain always runs in float64)")
    if conv1d_kernel_size is not None and (isinstance(conv1d_kernel_size, bool)
                                           or not isinstance(conv1d_kernel_size, int) or conv1d_kernel_size < 1):
        raise arg_error("conv1d_kernel_size", conv1d_kernel_size, "a positive int or None")
    offsets = _host_offsets(cu_seqlens, cu_seqlens_cpu)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    lengths = _slice_lengths(slice_lengths, offsets[-1], world_size)
    plan = plan_slice(offsets, lengths, rank)
    local_cpu = torch.tensor(plan.offsets, dtype=cu_seqlens.dtype)
    logger.debug("context parallel rank %d/%d: tokens [%d, %d), local offsets %s, %d earlier / %d later ranks",
                 rank, world_size, plan.start, plan.start + lengths[rank], list(plan.offsets), plan.pre_num_ranks,
                 plan.post_num_ranks)
    return CPContext(
        group=group, cu_seqlens=local_cpu.to(cu_seqlens.device), cu_seqlens_cpu=local_cpu, rank=rank,
        world_size=world_size, slice_lengths=lengths, start=plan.start, first_seq_index=plan.first_seq_index,
        pre_num_ranks=plan.pre_num_ranks, post_num_ranks=plan.post_num_ranks, crossings=plan.crossings,
        local_offsets=plan.offsets, conv1d_kernel_size=conv1d_kernel_size, pre_num_conv_tokens=plan.pre_num_conv_tokens)


def _host_offsets(cu_seqlens, cu_seqlens_cpu) -> list[int]:
    # imported here: the KDA package imports this module (its public function takes a CPContext)
    from kda_compile.ops.delta_rule.validation import INDEX_DTYPES, check_cu_seqlens_values

    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=INDEX_DTYPES)
    if cu_seqlens.shape[0] < 2:
        raise arg_error("cu_seqlens", describe(cu_seqlens), "[N + 1] offsets of N >= 1 sequences")
    if cu_seqlens_cpu is not None:
        check_tensor("cu_seqlens_cpu", cu_seqlens_cpu, ndim=1, dtypes=INDEX_DTYPES)
        if cu_seqlens_cpu.device.type != "cpu" or cu_seqlens_cpu.shape != cu_seqlens.shape:
            raise arg_error("cu_seqlens_cpu", describe(cu_seqlens_cpu),
                            f"a CPU copy of cu_seqlens ({cu_seqlens.shape[0]} offsets)")
    offsets = (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).tolist()
    check_cu_seqlens_values(offsets, offsets[-1])
    return offsets


def _slice_lengths(slice_lengths, total: int, world_size: int) -> tuple[int, ...]:
    if slice_lengths is None:
        if total % world_size != 0 or total == 0:
            raise arg_error("cu_seqlens", f"{total} tokens in all (cu_seqlens[-1])",
                            f"a positive multiple of the group size {world_size} for equal slices; pass "
                            "slice_lengths=[...] (tokens per rank) for uneven slices")
        return (total // world_size,) * world_size
    lengths = tuple(slice_lengths)
    if len(lengths) != world_size:
        raise arg_error("slice_lengths", list(lengths), f"one length per rank of the group ({world_size} ranks)")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise arg_error("slice_lengths", list(lengths), "positive ints (every rank holds at least one token)")
    if sum(lengths) != total:
        raise arg_error("slice_lengths", f"{list(lengths)} (sum {sum(lengths)})",
                        f"lengths summing to cu_seqlens[-1] = {total}, the packed tokens of all ranks")
    return lengths


def context_offsets(ctx, q, cu_seqlens, cu_seqlens_cpu) -> tuple[torch.Tensor, torch.Tensor]:
    """The offsets a call with ``cp_context=ctx`` runs with (the context's: this rank's sequences), after the
    checks only a context allows: its type, no other offsets, q holding this rank's slice."""
    if not isinstance(ctx, CPContext):
        raise arg_error("cp_context", describe(ctx), "None or a kda_compile.ops.CPContext from "
                        "kda_compile.ops.build_cp_context (FLA's FLACPContext is not accepted)", kind=TypeError)
    for name, given, own in (("cu_seqlens", cu_seqlens, ctx.cu_seqlens),
                             ("cu_seqlens_cpu", cu_seqlens_cpu, ctx.cu_seqlens_cpu)):
        if given is not None and given is not own:
            raise arg_error(name, describe(given), f"None or cp_context.{name} when cp_context is given (the "
                            "context holds this rank's offsets; build_cp_context takes the global ones)")
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        if q.shape[1] != ctx.local_length:
            raise arg_error("q", describe(q), f"this rank's slice of the packed tokens, [1, T, H, K] with T = "
                            f"{ctx.local_length} (cp_context.slice_lengths[{ctx.rank}])")
        if ctx.cu_seqlens.device != q.device:
            raise arg_error("cp_context", f"offsets on {ctx.cu_seqlens.device}",
                            f"built from a cu_seqlens on q's device {q.device}")
    return ctx.cu_seqlens, ctx.cu_seqlens_cpu
