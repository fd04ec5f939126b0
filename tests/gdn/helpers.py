"""Shared helpers of the GDN tests: the fp64 token-loop ground truth of a drawn call, and the op-level
arguments built from public ones as ``chunk_gated_delta_rule`` builds them."""
import torch

from kda_compile.ops.gdn.reference import gdn_recurrence

TENSORS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def expected_fp64(args):
    """``(o, final_state)`` of the token loop in fp64 for a drawn GDN call (state in the call's layout)."""
    f64 = {n: (args[n].double() if args.get(n) is not None else None) for n in TENSORS}
    h0 = f64["initial_state"]
    if h0 is not None and args["state_v_first"]:
        h0 = h0.transpose(-1, -2)
    o, final = gdn_recurrence(
        f64["q"], f64["k"], f64["v"], f64["g"], f64["beta"], scale=args["scale"], initial_state=h0,
        cu_seqlens=args["cu_seqlens"], A_log=f64["A_log"], dt_bias=f64["dt_bias"],
        use_qk_l2norm_in_kernel=args["use_qk_l2norm_in_kernel"], use_gate_in_kernel=args["use_gate_in_kernel"],
        use_beta_sigmoid_in_kernel=args["use_beta_sigmoid_in_kernel"], allow_neg_eigval=args["allow_neg_eigval"])
    return o, (final.transpose(-1, -2) if args["state_v_first"] else final)


def op_tensors(a):
    gate = a["use_gate_in_kernel"]
    h0 = a["initial_state"]
    if h0 is not None and a["state_v_first"]:
        h0 = h0.transpose(-1, -2)
    return (a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"] if gate else None, a["dt_bias"] if gate else None,
            h0, a["cu_seqlens"])


def op_flags(a):
    scale = a["scale"] if a["scale"] is not None else a["q"].shape[-1] ** -0.5
    return (float(scale), a["output_final_state"], a["use_qk_l2norm_in_kernel"], a["use_gate_in_kernel"],
            a["use_beta_sigmoid_in_kernel"], a["allow_neg_eigval"])


def loss_weights(o, final, seed=1):
    """Random cotangents for ``o`` and the final state (the gradient test's loss is their dot product)."""
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)
    dht = None if final is None else torch.randn(final.shape, generator=gen, dtype=torch.float64).to(o.device)
    return do, dht
