"""``torch.ops.kda_compile.compressed_selected_keys``: the indexer's picks of a CSA layer as rows of the key tensor
``compressed_sparse_attention`` builds (window keys first), their range checked where value checks run.

An op of its own so that the check runs when the call runs, compiled or not: in a compiled graph a value check in
the traced Python would be a guard on data (docs/op-input-errors.md).
"""
from __future__ import annotations

import torch
from torch import Tensor

from kda_compile.ops._common import out_of_range_error, values_checked


@torch.library.custom_op("kda_compile::compressed_selected_keys", mutates_args=())
def compressed_selected_keys(selected: Tensor, offset: int, entries: int) -> Tensor:
    """int32 ``selected + offset`` where ``selected >= 0``, -1 elsewhere; a pick outside ``[-1, entries)`` is a
    ``ValueError`` naming it (on the CPU always, on CUDA with ``KDA_COMPILE_CHECK_INPUTS=1``)."""
    if values_checked(selected):
        bad = (selected < -1) | (selected >= entries)
        if bool(bad.any()):
            raise out_of_range_error("selected", selected, bad,
                                     f"-1 (none) or compressed entries in [0, Tc) = [0, {entries})")
    return torch.where(selected >= 0, selected + offset, -1).to(torch.int32).contiguous()


@compressed_selected_keys.register_fake
def _compressed_selected_keys_fake(selected, offset, entries):
    return torch.empty(selected.shape, dtype=torch.int32, device=selected.device)
