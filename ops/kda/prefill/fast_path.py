"""Eager KDA and GDN prefill inference on our CUDA kernels with the host work done once per call signature.

An eager ``chunk_kda`` call through the ordinary path checks its arguments, chooses a backend and kernels, plans
the chunks of packed sequences, allocates a dozen tensors and builds each kernel's ctypes argument list: hundreds
of Python calls, more host time than a short prefill's kernels take (docs/kda-kernels.md section 8). Here a *plan*
keeps, per call signature, what that work decided: the loaded prepare and scan kernels (and, for more than
``INLINE_SEQS`` packed sequences, ``cuda_chunk_plan``'s kernel, which replaces the planning ops; with fewer the
two kernels find their chunks from ``cu_seqlens`` alone), their
grids and argument blocks with the scalars filled in, and the byte layout of one workspace holding every
intermediate. A call whose signature has a plan then allocates three tensors (``o``, the final state, the
workspace), writes the pointers of its tensors into the argument blocks (one ``struct.pack_into`` each) and
launches 2 kernels (3 with more than ``INLINE_SEQS`` packed sequences) on the current stream through prepared
launches (ctypes values made once: ``_nvrtc.PreparedLaunch``), the prepare kernel before the outputs are allocated:
no device synchronisation, no host-to-device copy, so it can be captured in a CUDA graph.

The signature holds everything the argument checks and the kernel choice read: every input's shape, dtype,
device and contiguity, the initial state's strides, every option, the kernel switches of the environment
(``KDA_COMPILE_PREPARE_KERNEL``, ``KDA_COMPILE_SCAN_KERNEL``, ``KDA_COMPILE_PREFILL_SEGMENTS``,
``KDA_COMPILE_CHECK_INPUTS``, ``TRITON_INTERPRET``) and the backend restriction (``backends.only_backends``).
Plans are learned, never guessed: a call of a new signature runs the ordinary path (its checks, its logging, its
fallbacks); at the second such call ``learn`` asks the ordinary path's own choice functions whether it ran our
CUDA prepare and scan kernels, and only then keeps a plan (a shape seen once, e.g. a new prompt length, costs only
its signature; the plan depends on the sequence length and count, so calls whose lengths always differ keep the
ordinary path). A call that would run anything else (FLA, the Triton
kernels, the reference), needs gradients, runs under a dispatch mode or a functorch transform, takes a DTensor,
or asks for ``check_inputs`` never reaches a plan. Value checks that cost no synchronisation still run on every
call (``cu_seqlens_cpu``'s offsets). At most ``MAX_PLANS`` signatures are kept (the oldest are dropped).
``KDA_COMPILE_LAUNCH_PLANS=0`` sends every call through the ordinary path.

GDN (``chunk_gated_delta_rule``) runs the same two kernels with the prepare compiled for the scalar gate
(``scalar_gate``) in their ``row_factors`` form (the prepare writes the rows' q / k factors, the scan reads the raw
q / k: ``plan.cuda_pair_served``, which the ordinary path takes for every call a plan can serve): its
calls learn plans the same way, with the gate's form in the signature's options and the GDN backend choice asked by
its caller (``served_by_our_kernels``), so nothing here imports GDN.

Ops layer: nothing here knows of torch.compile beyond declining to run while Dynamo traces.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from kda_compile.ops._common import cuda_index, on_device
from kda_compile.ops._nvrtc import NvrtcUnavailable, current_raw_stream, ensure_thread_context
from kda_compile.ops.kda.prefill.cuda import chunk_plan as cuda_chunk_plan
from kda_compile.ops.kda.prefill.cuda.launch import CHUNK_PLAN, PREPARE, SCAN, scan_scalars
from kda_compile.ops.kda.prefill.cuda import prepare_source as prepare_src
from kda_compile.ops.kda.prefill.chunks import CHUNK, chunks_in, packed_slot_bound
from kda_compile.ops.kda.backends.registry import KDAOptions, restricted_to, select_backend
from kda_compile.ops import envs

logger = logging.getLogger("kda_compile.ops.kda")

MAX_PLANS = 256
HEAD_DIM = 128
ALIGN = 256  # bytes between workspace regions
PLANS_ENV = envs.LAUNCH_PLANS  # "0": every call takes the ordinary path (debugging, measuring)
_ENVIRONMENT = (PLANS_ENV, envs.PREPARE_KERNEL, envs.SCAN_KERNEL, envs.PREFILL_SEGMENTS, envs.CHECK_INPUTS,
                "TRITON_INTERPRET")
_PLANS_ON = (None, "", b"", "1", b"1")  # KDA_COMPILE_LAUNCH_PLANS values that keep the plans on
_UNSET_OR_OFF = (None, "", b"", "0", b"0")  # KDA_COMPILE_CHECK_INPUTS values that ask for no value checks
_plans: dict[tuple, "Plan | None"] = {}  # signature -> plan, or None: the ordinary path serves it
_seen: dict[tuple, None] = {}  # signatures served once by the ordinary path (insertion-ordered, bounded)
_plans_lock = threading.Lock()


def _meta(t):
    if not isinstance(t, torch.Tensor):  # None, or a bad argument: its call takes the ordinary path's checks
        return None if t is None else (type(t),)
    return (t.shape, t.dtype, t.get_device(), t.is_contiguous())


_environment = envs.raw_reader(_ENVIRONMENT)  # the raw values, read fast: part of every signature


def signature(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, A_log, dt_bias, options: tuple):
    """The plan key of a ``chunk_kda`` or ``chunk_gated_delta_rule`` call, or None for calls no plan can serve (not
    bf16 CUDA q [B, T, H, 128], or while Dynamo traces). ``options``: every other argument of the call, as given
    (GDN's start with the op's name). The key holds only what is needed
    (a signature costs host time on every call): per tensor its shape, dtype, device index and contiguity, and the
    initial state's strides (the scan reads any)."""
    if (torch.compiler.is_compiling() or type(q) is not torch.Tensor or not q.is_cuda or q.dtype != torch.bfloat16
            or q.dim() != 4 or q.shape[-1] != HEAD_DIM):
        return None
    environment = _environment()
    if (environment[0] not in _PLANS_ON and not envs.launch_plans()) or environment[4] not in _UNSET_OR_OFF:
        return None  # plans switched off, or KDA_COMPILE_CHECK_INPUTS set (its checks run in the ordinary path)
    h0 = (_meta(initial_state), initial_state.stride()) if isinstance(initial_state, torch.Tensor) else _meta(
        initial_state)
    return (q.shape, q.get_device(), q.is_contiguous(), _meta(k), _meta(v), _meta(g), _meta(beta), h0,
            _meta(cu_seqlens), _meta(cu_seqlens_cpu), _meta(A_log), _meta(dt_bias), options, environment,
            restricted_to())


def lookup(key) -> "Plan | None":
    return _plans.get(key)


@dataclass(frozen=True)
class _Layout:
    """Byte offsets of the intermediates in the workspace."""

    w: int
    u: int
    qg: int
    kd: int
    a_qk: int
    decay: int
    chunk_offsets: int
    size: int


def _layout(tokens: int, HV: int, slots: int, num_seqs: int, row_factors: bool = False) -> _Layout:
    """``row_factors``: the ``qg`` region holds the rows' q / k factors ``[slots, HV, 2, 64]`` fp32 and there is no
    ``kd`` (the scalar-gate kernel pair, ``plan.cuda_pair_served``)."""
    tile = tokens * HV * HEAD_DIM * 2
    sizes = {"w": tile, "u": tile, "qg": slots * HV * 2 * CHUNK * 4 if row_factors else tile,
             "kd": 0 if row_factors else tile, "a_qk": tokens * HV * CHUNK * 2, "decay": slots * HV * HEAD_DIM * 4,
             "chunk_offsets": (num_seqs + 1) * 4}
    offsets, at = {}, 0
    for name, size in sizes.items():
        offsets[name] = at
        at += -(-size // ALIGN) * ALIGN
    return _Layout(**offsets, size=at)


class Plan:
    """One signature's kernels, grids, argument blocks and workspace layout; calling it runs the forward."""

    def __init__(self, *, device_index, o_shape, final_shape, state_v_first, layout, prepare, slots, scan, block_v,
                 planner, has_a_log, has_dt_bias, has_h0, varlen, scale,
                 beta_scale, lower_bound, T, N, H, HV, h0_strides, row_factors=False):
        self.device_index, self.layout = device_index, layout
        self.o_shape = o_shape
        # the final state is allocated in the layout the caller gets: the kernel writes [N, HV, K, V] contiguously,
        # which with state_v_first is the [N, HV, V, K] view of those bytes (what the ordinary path returns)
        self.final_size = self.final_stride = None
        if final_shape is not None:
            N_, HV_, K_, V_ = final_shape
            contiguous = (HV_ * K_ * V_, K_ * V_, V_, 1)
            self.final_size = (N_, HV_, V_, K_) if state_v_first else final_shape
            self.final_stride = (*contiguous[:2], 1, V_) if state_v_first else contiguous
        self.has_a_log, self.has_dt_bias, self.has_h0, self.varlen = has_a_log, has_dt_bias, has_h0, varlen
        self.row_factors = row_factors
        # the argument blocks of the launch descriptions (launch.py); their pointers are set per call, in order
        self.prepare_args = PREPARE.block(dict(T=T, N=N, H=H, HV=HV, scale=scale, beta_scale=beta_scale,
                                               lower_bound=lower_bound))
        self.scan_args = SCAN.block(scan_scalars(T, HV, H if row_factors else HV, h0_strides))
        # the chunk plan's kernel: more than INLINE_SEQS packed sequences (fewer: the kernels read cu_seqlens alone)
        self.planner_args = CHUNK_PLAN.block(dict(N=N)) if planner is not None else None
        # (chunk plan or None, prepare, scan): launched with the argument blocks above on the caller's stream
        self._launches = tuple(
            None if block is None else kernel.launcher(grid, threads, block)
            for kernel, grid, threads, block in (
                (planner, CHUNK_PLAN.grid(), CHUNK_PLAN.threads(), self.planner_args),
                (prepare, PREPARE.grid(slots, HV), PREPARE.threads(), self.prepare_args),
                (scan, SCAN.grid(block_v, HV, N), SCAN.threads(block_v), self.scan_args)))
        self._lock = threading.Lock()

    def __call__(self, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens):
        """``(o, final state or None)``, the final state in the caller's layout; ``initial_state`` as the caller
        passed it (only its address is read: the plan holds the strides of its kernel view). The prepare kernel
        needs only the inputs and the workspace, so it is launched before the outputs are allocated: their host
        time then runs beside it instead of before it."""
        workspace = q.new_empty(self.layout.size, dtype=torch.uint8)
        at, lay = workspace.data_ptr(), self.layout
        w, u, qg, kd, a_qk, decay = (at + lay.w, at + lay.u, at + lay.qg, at + lay.kd, at + lay.a_qk, at + lay.decay)
        qp, kp = q.data_ptr(), k.data_ptr()
        varlen = self.varlen
        cu = cu_seqlens.data_ptr() if varlen else qp
        offsets = at + lay.chunk_offsets if varlen else qp
        index = self.device_index
        with self._lock, on_device(index):
            ensure_thread_context(index)
            stream = current_raw_stream(index)
            planner, prepare, scan = self._launches
            if self.planner_args is not None:
                self.planner_args.set_pointers((cu, offsets))
                planner(stream)
            self.prepare_args.set_pointers((
                qp, kp, v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                A_log.data_ptr() if self.has_a_log else w, dt_bias.data_ptr() if self.has_dt_bias else w,
                w, u, qg, w if self.row_factors else kd, a_qk, decay, w, cu, offsets))
            prepare(stream)
            o = q.new_empty(self.o_shape)
            final = None if self.final_size is None else q.new_empty_strided(self.final_size, self.final_stride,
                                                                               dtype=torch.float32)
            # row factors: the prepare wrote the factors where qg would be; the scan reads them with the raw q / k
            scan_q, scan_k, factors = (qp, kp, qg) if self.row_factors else (qg, kd, w)
            self.scan_args.set_pointers((
                w, u, scan_q, scan_k, a_qk, decay, o.data_ptr(), initial_state.data_ptr() if self.has_h0 else w,
                final.data_ptr() if final is not None else w, cu if varlen else w, offsets if varlen else w,
                factors))
            scan(stream)
        return o, final


def learn(key, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *, scale: float, output_final_state: bool,
          use_qk_l2norm_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, safe_gate: bool,
          lower_bound: float | None, chunk_size: int, state_v_first: bool, scalar_gate: bool = False,
          served_by_our_kernels: Callable[[], bool] | None = None) -> None:
    """After the ordinary path served an eager inference call of signature ``key``: keep a plan when that call ran
    our CUDA prepare and scan kernels (asked of the same choice functions), else remember that none applies.
    ``initial_state`` in the kernel's ``[N, HV, K, V]`` view; ``state_v_first``: the caller's layout of the states
    (a planned call reads the initial state's address and returns the final state in that layout). KDA: the
    in-kernel gates (lower-bound or softplus). GDN (``scalar_gate``): the scalar gate, in-kernel (``A_log`` given)
    or finished; ``served_by_our_kernels`` says whether GDN's backend choice takes our chunk kernels for this
    call."""
    if key is None or key in _plans:
        return
    with _plans_lock:  # a plan from the second call of a signature on: a shape seen once (a new prompt length)
        if key not in _seen:  # costs its signature and this insert, not a plan it would never use
            if len(_seen) >= MAX_PLANS:
                del _seen[next(iter(_seen))]
            _seen[key] = None
            return
        del _seen[key]
    try:
        plan = _build(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, output_final_state,
                      use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
                      chunk_size, state_v_first, scalar_gate, served_by_our_kernels)
    except NvrtcUnavailable as exc:  # the ordinary path has recorded this as a fallback already
        logger.debug("no launch plan: %s", exc)
        plan = None
    with _plans_lock:
        if len(_plans) >= MAX_PLANS:
            del _plans[next(iter(_plans))]
        _plans[key] = plan


def _build(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, scale, output_final_state, l2norm, beta_sigmoid,
           neg_eig, safe_gate, lower_bound, chunk_size, state_v_first, scalar_gate=False,
           served_by_our_kernels=None) -> Plan | None:
    # here, not at import: these need triton, which CPU-only installs may lack
    from kda_compile.ops.kda.prefill.cuda import prepare as cuda_prepare
    from kda_compile.ops.kda.prefill.cuda import scan as cuda_scan
    from kda_compile.ops.kda.prefill.plan import cuda_scan_is_faster, device_sms
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    varlen = cu_seqlens is not None
    N = cu_seqlens.shape[0] - 1 if varlen else B
    if B * T == 0 or N <= 0 or K != HEAD_DIM or V != HEAD_DIM or (scalar_gate and lower_bound is not None):
        return None  # (GDN takes no lower bound)
    if not all(t.is_contiguous() for t in (q, k, v, g, beta)):
        return None
    for name, t, numel in (("A_log", A_log, HV), ("dt_bias", dt_bias, HV if scalar_gate else HV * K)):
        if t is not None and (t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != numel):
            return None  # the ordinary path converts them on every call
    if varlen and (not cu_seqlens.is_contiguous() or cu_seqlens.device != q.device):
        return None
    if h0 is not None and h0.device != q.device:
        return None
    if scalar_gate:
        if served_by_our_kernels is None or not served_by_our_kernels():
            return None
    else:
        opts = KDAOptions(scale=scale, use_qk_l2norm_in_kernel=l2norm, use_gate_in_kernel=True,
                          use_beta_sigmoid_in_kernel=beta_sigmoid, allow_neg_eigval=neg_eig, lower_bound=lower_bound,
                          safe_gate=safe_gate, chunk_size=chunk_size)
        if select_backend("chunk_kda", q.device, q.dtype, K, V, opts).name != "triton_chunk":
            return None
    op = "chunk_gdn" if scalar_gate else "chunk_kda"
    if cuda_prepare.choose_prepare_kernel(q, k, v, g, beta, cu_seqlens, not scalar_gate, lower_bound,
                                          scalar_gate=scalar_gate, op=op) != "cuda":
        return None
    no_offsets = torch.empty(0, dtype=torch.int32)
    scan_choice = cuda_scan.choose_scan_kernel(
        q, v, h0, cu_seqlens if varlen else no_offsets, num_seqs=N, gate_cumsum=False, writes_chunk_states=False,
        writes_o=True, segments_asked=envs.prefill_segments() is not None,
        cuda_faster=lambda: cuda_scan_is_faster(q.device, N, HV, K, V, T, varlen, h0 is not None))
    if scan_choice != "cuda":
        return None
    index = cuda_index(q.device)
    block_v = cuda_scan.block_v_for(N * HV, device_sms(q.device))
    slots = packed_slot_bound(T, N) if varlen else B * chunks_in(T)
    cu_dtype = cu_seqlens.dtype if varlen else None
    flags = (varlen, l2norm, A_log is not None, dt_bias is not None, beta_sigmoid, False)
    softplus, wide = (False, False) if scalar_gate else cuda_prepare.channel_gate_form(lower_bound)
    planned = varlen and N > prepare_src.INLINE_SEQS  # a chunk plan launched before the kernels (else none)
    with on_device(index):
        ensure_thread_context(index)
        prepare = cuda_prepare.prepare_kernel(index, g.dtype, beta.dtype, cu_dtype, flags, scalar_gate=scalar_gate,
                                              row_factors=scalar_gate, softplus_gate=softplus, wide_blocks=wide,
                                              inline_offsets=varlen and not planned)
        scan = cuda_scan.scan_kernel(index, cu_dtype, h0 is not None, output_final_state, block_v,
                                     row_factors=scalar_gate)
        planner = cuda_chunk_plan.chunk_plan_kernel(index, cu_dtype) if planned else None
    return Plan(device_index=index, o_shape=(B, T, HV, V), final_shape=(N, HV, K, V) if output_final_state else None,
                state_v_first=state_v_first, layout=_layout(B * T, HV, slots, N, row_factors=scalar_gate),
                prepare=prepare, slots=slots, scan=scan, block_v=block_v, planner=planner,
                has_a_log=A_log is not None,
                has_dt_bias=dt_bias is not None, has_h0=h0 is not None, varlen=varlen, scale=scale,
                beta_scale=2.0 if neg_eig else 1.0, lower_bound=0.0 if lower_bound is None else lower_bound,
                T=T, N=N, H=H, HV=HV,
                h0_strides=h0.stride() if h0 is not None else (0, 0, 0, 0),
                row_factors=scalar_gate)


def plan_count() -> int:
    """How many signatures have a plan (tests)."""
    return sum(plan is not None for plan in list(_plans.values()))


def clear_plans() -> None:
    """Forget every plan (tests; after changing what a signature cannot see, e.g. a kernel source)."""
    with _plans_lock:
        _plans.clear()
        _seen.clear()
