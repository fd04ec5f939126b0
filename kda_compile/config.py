"""The configuration of :func:`kda_compile.optimize` and of the ``kda_compile`` backend."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kda_compile.ops import envs

COMPILERS = ("inductor", "aot_eager", "eager")
NOT_REWRITES = ("capture_data_dependent_ops", "strict", "skip_decode_guards")  # boolean fields that switch something other than a rewrite


@dataclass(frozen=True)
class Config:
    """Which graph rewrites run, and what compiles the rewritten graph.

    Each boolean rewrite field is named after the rewrite it switches (the pass manager looks
    rewrites up by that name), so ``Config(softmax_attention=False)`` turns the attention rewrite
    off and leaves the graph to Inductor as torch.compile would.

    Attributes:
        softmax_attention: rewrite Hugging Face eager softmax attention
            (``softmax(q @ k^T * scale + mask) @ v`` and its softcap / sinks / GQA variants) into
            ``kda_compile.ops.attention``.
        sdpa_attention: rewrite torch's ``scaled_dot_product_attention`` calls (Hugging Face's
            default ``"sdpa"`` attention, with ``repeat_kv`` or ``enable_gqa``) into
            ``kda_compile.ops.attention``, keys and values un-repeated.
        attention_mask_to_flags: when the graph proves an attention mask is the causal mask (or
            causal + sliding window, possibly with key padding), pass ``is_causal`` /
            ``sliding_window`` (and a ``[B, 1, 1, Sk]`` padding mask) instead of the T x T mask.
        kda_substitution: trace-time substitution of the known KDA entry points (FLA's
            ``chunk_kda`` / ``fused_recurrent_kda``, Hugging Face's ``chunk_kimi_delta_attention`` /
            ``recurrent_kimi_delta_attention``) by ``kda_compile.ops``. The substitutes are
            registered process-wide when kda_compile is first used (``optimize()`` or the backend:
            kda_compile/process_hooks.py); each decides at trace time from the backend Dynamo
            compiles for, so with ``False`` this backend traces the original code (FLA's functions
            then break the graph) while other backends keep the substitution. The environment
            variable ``KDA_COMPILE_SUBSTITUTION=0`` registers nothing at all.
        kda_recurrence: collapse a token-by-token delta-rule recurrence written inline (and
            unrolled by Dynamo) into one KDA op call.
        kda_prologue: fold the gate (softplus / lower-bound form), the beta sigmoid and the q/k
            L2 norm computed right before a KDA op into the op's in-kernel options.
        delta_rule_state_in_place: a KDA / GDN decode step whose final state is copied back into the
            cache tensor it read its initial state from writes that state in place instead
            (``inplace_final_state=True``): no fresh state, no copy (passes/delta_rule/state_in_place.py).
        dsa_attention: rewrite Hugging Face's DeepSeek Sparse Attention (the indexer's scores and
            top-k, and the attention over its top-k mask) into ``kda_compile.ops.dsa_indexer_topk``
            and ``kda_compile.ops.dsa_sparse_attention`` (docs/dsa-rewrite.md).
        compressed_attention: rewrite DeepSeek-V4's compressed attention layers (CSA, HCA: window keys and
            compressed entries under one dense mask) into ``kda_compile.ops.compressed_sparse_attention``
            (passes/dsa/compressed.py; docs/dsa.md, section 6).
        mla_absorb: rewrite Hugging Face's MLA expand-then-attend (``kv_b_proj`` over the latent
            cache, then attention) into ``kda_compile.ops.mla_attention`` (absorbed decode).
        capture_data_dependent_ops: calls of an :func:`kda_compile.optimize` result run with Dynamo's
            ``capture_scalar_outputs`` and ``capture_dynamic_output_shape_ops`` on (set for the call,
            restored after): model-side MoE routing (``nonzero``, ``torch.where(mask)``, ``.item()``,
            ``.tolist()``) is then captured into the graph with unbacked sizes instead of breaking it.
            ``False`` leaves Dynamo's config as the user set it. ``torch.compile(model, backend="kda_compile")``
            does the same through the context Dynamo enters around each call for a backend
            (``KdaCompileBackend.backend_ctx_ctor``); with ``False`` there, the report counts the breaks at
            data-dependent ops and names the two Dynamo options.
        strict: turn every slower path into a ``kda_compile.StrictModeError`` carrying the report's reason and
            site, for a CI that must know a model is fully rewritten: a candidate a rewrite left alone, a graph
            left out of CUDA graphs for a reason other than being a prefill (raised when the graph compiles), an
            op fallback to a slower implementation, an eager fallback of Dynamo, or a graph break inside
            kda_compile's own code (raised by a call of an :func:`kda_compile.optimize` result). Default: on when
            the environment variable ``KDA_COMPILE_STRICT=1`` is set when the Config is made (the backend
            ``"kda_compile"``'s Config is made at import), else off.
        skip_decode_guards: for :func:`kda_compile.optimize` results with CUDA graphs (``mode="reduce-overhead"``)
            only: a decode step into a static cache that has run once (same cache, batch size, grad / inference
            mode and training flag) runs its later calls with only Dynamo's differentiating guards (every tensor
            shape, dtype and device, and what told the compiled entries apart), a large part of such a step's
            host time (kda_compile/decode_guards.py; docs/cuda-graphs.md, section 9). Unsafe where a module, parameter or config attribute of
            the model is replaced between decode steps: Dynamo would no longer see it. Default off.
        compiler: what runs the rewritten graph: ``"inductor"`` (default; takes ``mode`` and
            ``options`` from torch.compile), ``"aot_eager"`` (AOTAutograd without code
            generation: quick, for debugging and tests) or ``"eager"`` (the rewritten graph as is).
    """

    softmax_attention: bool = True
    sdpa_attention: bool = True
    attention_mask_to_flags: bool = True
    kda_substitution: bool = True
    kda_recurrence: bool = True
    kda_prologue: bool = True
    delta_rule_state_in_place: bool = True
    dsa_attention: bool = True
    compressed_attention: bool = True
    mla_absorb: bool = True
    capture_data_dependent_ops: bool = True
    strict: bool = dataclasses.field(default_factory=envs.strict)
    skip_decode_guards: bool = False
    compiler: str = "inductor"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in (bool, "bool") and not isinstance(value, bool):
                raise TypeError(f"Config.{f.name} must be a bool, got {value!r}")
        if self.compiler not in COMPILERS:
            raise ValueError(f"Config.compiler must be one of {', '.join(COMPILERS)}, got {self.compiler!r}")

    def rewrite_enabled(self, name: str) -> bool:
        """Whether the rewrite registered as ``name`` runs (every rewrite has a field of its name)."""
        value = getattr(self, name, None)
        if not isinstance(value, bool) or name in NOT_REWRITES:
            fields = [f.name for f in dataclasses.fields(self) if f.type in (bool, "bool") and f.name not in NOT_REWRITES]
            raise ValueError(f"rewrite name must be a rewrite's Config field ({', '.join(fields)}), got {name!r}")
        return value
