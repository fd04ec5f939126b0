"""The check both delta-rule decode ops that write their state in place share (``fused_recurrent_kda_inplace``,
``fused_recurrent_gdn_inplace``): against the out-of-place decode op on the same inputs, and through opcheck."""
import torch


def check_in_place_decode(name: str, tensors: tuple, scale: float, flags: tuple) -> None:
    """``torch.ops.kda_compile.<name>_inplace`` leaves in its ``state`` the final state ``<name>_fwd`` returns,
    with the same ``o``, to the bit (the same kernel on the same inputs), and passes ``opcheck`` (its declared
    mutation, its fake). ``tensors``: the ops' nine tensor arguments, the initial state eighth (any strides: a
    clone keeps them); ``flags``: what follows ``output_final_state`` in the ``_fwd`` op's schema."""
    fwd, in_place = getattr(torch.ops.kda_compile, f"{name}_fwd"), getattr(torch.ops.kda_compile, f"{name}_inplace")
    o_ref, final_ref = fwd(*tensors, scale, True, *flags)
    state = tensors[7].clone()
    o = in_place(*tensors[:7], state, tensors[8], scale, *flags)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(state, final_ref, rtol=0, atol=0)
    torch.library.opcheck(in_place.default, (*tensors[:7], tensors[7].clone(), tensors[8], scale, *flags))
