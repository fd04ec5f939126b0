"""qwen4_exp's QSA indexer traced without a graph break.

Hugging Face's ``Qwen4ExpTextQSAIndexer.forward`` (models/qwen4_exp/modeling_qwen4_exp.py, transformers 5.23)
selects, for every query, the keys its full-attention layer attends to. Per batch row and per query, in a
Python loop, it takes the visible keys (``nonzero`` of the mask row), groups them into blocks of
``compress_ratio`` consecutive visible keys, pools each complete block (fp32 mean, ``k_layernorm``, RoPE at the
block's first key), scores the blocks against the query (``relu(q . k)`` summed over the indexer heads,
``/ sqrt(d)``), keeps the ``token_budget // compress_ratio`` best, and adds the visible keys after the last
complete block (the tail). It returns the ``[B, 1, S, T]`` boolean mask of the selected keys. Its
``if num_complete_blocks > 0`` branches on a data-dependent count, so Dynamo breaks the graph there (and,
inside the loop, gives up on the whole frame): the attention's weights then cross a graph boundary and the
softmax attention rewrite leaves that layer alone.

Once kda_compile is in use (optimize() or its backend), Dynamo traces :func:`qsa_selection_mask` instead: the same
selection for every query at once, with shapes that do not depend on the data. For each query row
(``visible = mask[:, 0]``, or ``mask[:, 0] == 0`` for eager's additive mask)::

    rank   = cumsum(visible) - 1                 # a visible key's place among the row's visible keys
    blocks = keys at ranks [j*C, (j+1)*C)        # j < T // C; block j is complete when j < count // C
    score  = sum_h relu(q[h] . rope(k_layernorm(mean(blocks[j]))))) / sqrt(d), -inf when not complete
    chosen = topk(score, min(topk, T // C)), its first min(topk, complete) places
    mask   = visible & (chosen[rank // C] | rank >= complete * C)

A row without a complete block chooses none (its ``complete`` is 0) and keeps its visible tail, as HF's
empty branch does: no branch on a value. The prologue (projection, norms, RoPE of the queries, the cache's
``update_indexer``) is HF's, run as written, and so are the block keys' fp32 mean, ``k_layernorm`` and RoPE
(HF's ``apply_rotary_pos_emb`` on ``[..., 1, d]`` keys); the scores are one batched matmul where HF runs one
per query (equal up to float rounding). So the mask is HF's wherever no two block scores tie, or come within
rounding of each other, at the ``topk`` boundary (tests/models/test_qwen4_exp_indexer.py compares them bit for
bit).

Ties: ``torch.topk`` leaves the order of equal values unspecified (on CPU, ``std::nth_element``'s). Where
every block of a row is complete (``complete == T // C``: every decode step without padding, the last prefill
rows) the call here is HF's own, over the same scores, and picks HF's blocks. A row with incomplete blocks
calls it over more entries (``-inf`` after the complete ones) than HF's, which can order a tie otherwise.
Ties are not rare in small models: a block whose every head score is negative scores exactly 0 (2 indexer
heads: one block in four). With many heads they practically vanish.

Cost: each row pools its own blocks (rows of one sequence see different keys), so the pooled keys are
``[B, S, T // C, d]`` (gathered one position of the block at a time; HF's loop holds one row's at a time),
beside ``[B, S, T]`` ranks and ``[B, S, T // C]`` scores. In a long prefill that is ``d / C`` times the
``[B, S, T]`` mask, per indexed layer.

Registration: when kda_compile installs its hooks (kda_compile/process_hooks.py), and when a transformers
modeling module is imported after that (substitution/install.py's import hook; nothing with
``KDA_COMPILE_SUBSTITUTION=0``). A module's ``forward`` is not
looked up in Dynamo's substitution table: Dynamo calls ``type(module).forward`` directly, after unwrapping that
function's ``_torchdynamo_inline`` attribute (the attribute torch.compile sets on its wrappers; read by Dynamo
in torch 2.13). So the substitute is set as that attribute of HF's ``forward``; eager calls never read it. A
function wrapping that ``forward`` with ``functools.wraps`` copies the attribute, so Dynamo traces the
substitute in the wrapper's place too (accelerate's hooks wrap it in a ``functools.partial``, which Dynamo
traces). A copy of the class in another modeling module (transformers' modular copies) is recognised when its
``forward`` has HF's bytecode, names and constants; the copy's own ``apply_rotary_pos_emb`` is then used.
``Config(dsa_attention=False)`` traces HF's code as written (the graph break stays), for that backend only; the
DSA rewrite reports each indexer of a graph (:func:`report_qsa_indexers`).
"""
from __future__ import annotations

import logging
import math
import os
import re
import sys
import threading
import types
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.fx

from kda_compile.passes.report import LeftAlone, Rewritten
from kda_compile.passes.substitution.substitutes import _compiling_config, _copy_of
from kda_compile.passes.toolkit.graph_tools import is_our_file, module_path

logger = logging.getLogger("kda_compile.passes.qsa_indexer")

HF_MODULE = "transformers.models.qwen4_exp.modeling_qwen4_exp"
HF_CLASS = "Qwen4ExpTextQSAIndexer"
SUBSTITUTE_ATTRIBUTE = "_torchdynamo_inline"
MODEL_MODULE = re.compile(r"transformers\.models\.\w+\.modeling_\w+$")
# What the substitute reads of the module (HF's indexer sets them in __init__).
ATTRIBUTES = ("layer_idx", "index_n_heads", "index_kv_heads", "index_head_dim", "compress_ratio", "block_topk",
              "index_qk_proj", "q_layernorm", "k_layernorm")


# ----------------------------------------------------------------------------------------------
# The selection, for every query at once
# ----------------------------------------------------------------------------------------------
def qsa_selection_mask(q: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       visible: torch.Tensor, *, compress_ratio: int, block_topk: int,
                       key_norm: Callable[[torch.Tensor], torch.Tensor], rope: Callable) -> torch.Tensor:
    """The ``[B, 1, S, T]`` mask of the keys HF's QSA indexer selects for each query.

    Args:
        q: the indexer's queries after their norm and RoPE, ``[B, S, H, d]``.
        keys: the indexer's raw keys, the cache's included, ``[B, T, d]``.
        cos, sin: RoPE tables at every key position, ``[B, T, r]``.
        visible: which keys each query sees, ``[B, S, T]`` bool.
        compress_ratio: keys per block (C); block_topk: blocks kept per query.
        key_norm: applied to the pooled block keys (HF's ``k_layernorm``).
        rope: HF's ``apply_rotary_pos_emb(x, cos=, sin=, unsqueeze_dim=)``.
    """
    batch, seq, kv_len = visible.shape
    size = compress_ratio
    n_blocks = kv_len // size  # the most complete blocks a row can have
    rank = visible.cumsum(-1) - 1  # [B, S, T] int64; meaningful where visible
    complete = torch.div(visible.sum(-1), size, rounding_mode="floor")  # [B, S] complete blocks of each row

    # The position of each row's r-th visible key, for r < T // C * C (positions of hidden keys fill the
    # rest: they belong to incomplete blocks only, which are never chosen).
    slot = torch.where(visible, rank, kv_len)  # hidden keys land in a spare last slot, dropped
    positions = torch.arange(kv_len, device=visible.device).expand(batch, seq, kv_len)
    by_rank = torch.zeros(batch, seq, kv_len + 1, dtype=torch.long, device=visible.device)
    by_rank = by_rank.scatter(-1, slot, positions)
    blocks = by_rank[..., : n_blocks * size].reshape(batch, seq, n_blocks, size)  # [B, S, NB, C] positions

    rows = torch.arange(batch, device=keys.device).view(batch, 1, 1)
    total = keys[rows, blocks[..., 0]].float()
    for offset in range(1, size):  # one block position at a time: no [B, S, NB, C, d] gather
        total = total + keys[rows, blocks[..., offset]].float()
    pooled = key_norm((total / size).to(keys.dtype))  # [B, S, NB, d]
    first = blocks[..., 0]
    block_keys = rope(pooled.unsqueeze(-2), cos=cos[rows, first], sin=sin[rows, first], unsqueeze_dim=-2)
    block_keys = block_keys.squeeze(-2)

    scores = torch.matmul(q.float(), block_keys.float().transpose(-1, -2))  # [B, S, H, NB]
    scores = torch.relu(scores).sum(dim=-2) / math.sqrt(q.shape[-1])  # [B, S, NB]
    index = torch.arange(n_blocks, device=scores.device)
    scores = scores.masked_fill(index >= complete.unsqueeze(-1), float("-inf"))  # incomplete blocks last
    top = torch.topk(scores, min(block_topk, n_blocks), dim=-1).indices  # HF's call where the row is full
    kept = torch.arange(top.shape[-1], device=top.device) < torch.clamp(complete, max=block_topk).unsqueeze(-1)
    chosen = torch.zeros(batch, seq, n_blocks + 1, dtype=torch.bool, device=top.device)  # + a spare block
    chosen = chosen.scatter(-1, top, kept)  # [B, S, NB + 1]: the chosen complete blocks

    block_of_key = torch.div(rank, size, rounding_mode="floor").clamp(0, n_blocks)
    in_chosen = chosen.gather(-1, block_of_key)
    tail = rank >= (complete * size).unsqueeze(-1)
    return (visible & (in_chosen | tail)).unsqueeze(1)


# ----------------------------------------------------------------------------------------------
# The substitute of the indexer's forward
# ----------------------------------------------------------------------------------------------
@torch._dynamo.assume_constant_result
def _substituting(where: str) -> bool:
    """Whether the graph being traced takes the branch-free selection for ``where`` (a constant to Dynamo)."""
    config = _compiling_config()
    if config is not None and not config.dsa_attention:
        logger.debug("%s traced as written (Config(dsa_attention=False))", where)
        return False
    return True


@torch._dynamo.assume_constant_result
def _declined(where: str, reason: str) -> bool:
    logger.warning("%s traced as written (graph break in its loop): %s", where, reason)
    return True


def _why_not(module: torch.nn.Module, attention_mask: Any, rope: Any) -> str:
    """Why this call cannot take the substitute ("" when it can); all of it is known at trace time."""
    missing = [name for name in ATTRIBUTES if not hasattr(module, name)]
    if missing:
        return f"the module has no {', '.join(missing)}"
    if module.index_kv_heads != 1:
        return f"index_kv_heads={module.index_kv_heads} (HF's pooling reads one key head)"
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        return "the attention mask is not a [B, heads, S, T] tensor"
    if not callable(rope):
        return "its module has no apply_rotary_pos_emb"
    return ""


# Per substitute, set in its own globals (make_substitute): HF's code as written, its module's RoPE helper and
# where it is. Globals, not a closure: Dynamo reads the substitute's closure cells through the source of the
# function it replaces, whose closure is HF's.
_TWIN: Callable | None = None
_ROPE: Callable | None = None
_WHERE = ""


def _qsa_indexer_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values):
    if not _substituting(_WHERE):
        return _TWIN(self, hidden_states, position_embeddings, attention_mask, past_key_values)
    reason = _why_not(self, attention_mask, _ROPE)
    if reason:
        _declined(_WHERE, reason)
        return _TWIN(self, hidden_states, position_embeddings, attention_mask, past_key_values)
    batch, seq, _ = hidden_states.shape
    width = self.index_head_dim
    cos, sin = position_embeddings  # every key's position; the queries are the last seq
    q, k = torch.split(self.index_qk_proj(hidden_states),
                       [self.index_n_heads * width, self.index_kv_heads * width], dim=-1)
    q = self.q_layernorm(q.reshape(batch, seq, -1, width))
    q = _ROPE(q, cos=cos[:, -seq:, :], sin=sin[:, -seq:, :], unsqueeze_dim=2)
    keys = k.reshape(batch, seq, -1, width).squeeze(2)
    if past_key_values is not None:
        keys = past_key_values.update_indexer(keys, self.layer_idx)
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    return qsa_selection_mask(q, keys, cos, sin, visible[:, 0], compress_ratio=self.compress_ratio,
                              block_topk=self.block_topk, key_norm=self.k_layernorm, rope=_ROPE)


def make_substitute(original: Callable, where: str) -> Callable:
    """The function Dynamo traces for ``original`` (HF's ``forward`` or a copy of it)."""
    # No __name__: Dynamo would read the globals of a named scope from that module, not from this dict.
    namespace = {name: value for name, value in globals().items() if name != "__name__"}
    namespace.update(_TWIN=_copy_of(original),  # made before the attribute is set: traced as HF wrote it
                     _ROPE=original.__globals__.get("apply_rotary_pos_emb"), _WHERE=where)
    substitute = types.FunctionType(_qsa_indexer_forward.__code__, namespace, "qsa_indexer_forward")
    substitute.__qualname__ = "qsa_indexer_forward"
    return substitute


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Registered:
    """One indexer class whose ``forward`` Dynamo traces as :func:`qsa_selection_mask`."""

    where: str  # module.Class
    original: Callable
    substitute: Callable
    by: str  # "identity" (HF's class) or "bytecode" (a copy)


_registered: dict[int, Registered] = {}  # id(original forward) -> entry; keeps the originals alive
_seen: dict[str, set[str]] = {}  # module name -> class names already looked at
_lock = threading.RLock()


def _fingerprint(code: types.CodeType) -> tuple:
    consts = tuple(_fingerprint(c) if isinstance(c, types.CodeType) else (type(c).__name__, repr(c))
                   for c in code.co_consts)
    return code.co_code, code.co_names, code.co_varnames, code.co_freevars, consts


def _reference() -> Callable | None:
    module = sys.modules.get(HF_MODULE)
    cls = getattr(module, HF_CLASS, None) if module is not None else None
    forward = getattr(cls, "forward", None)
    return forward if isinstance(forward, types.FunctionType) else None


def _register(where: str, forward: Callable, by: str) -> None:
    with _lock:
        if id(forward) in _registered:
            return
        if SUBSTITUTE_ATTRIBUTE in vars(forward):
            logger.warning("%s.forward already has %s: not substituted", where, SUBSTITUTE_ATTRIBUTE)
            return
        substitute = make_substitute(forward, where)
        setattr(forward, SUBSTITUTE_ATTRIBUTE, substitute)
        _registered[id(forward)] = Registered(where, forward, substitute, by)
        logger.debug("substituting %s.forward (recognised by %s)", where, by)


def register_loaded_indexers() -> None:
    """Substitute HF's QSA indexer and every copy of it in the imported transformers modeling modules
    (each class looked at once)."""
    reference = _reference()
    if reference is not None:
        _register(f"{HF_MODULE}.{HF_CLASS}", reference, "identity")
    wanted = _fingerprint(reference.__code__) if reference is not None else None
    for module_name, module in list(sys.modules.items()):
        if module is None or not MODEL_MODULE.match(module_name) or module_name == HF_MODULE:
            continue
        with _lock:
            seen = _seen.setdefault(module_name, set())
            fresh = [(name, value) for name, value in list(vars(module).items())
                     if name not in seen and isinstance(value, type) and name.endswith("QSAIndexer")]
            if wanted is not None:  # without the reference nothing is compared: look again later
                seen.update(name for name, _ in fresh)
        if wanted is None:
            continue
        for name, cls in fresh:
            forward = vars(cls).get("forward")
            if (isinstance(forward, types.FunctionType) and getattr(cls, "__module__", None) == module_name
                    and _fingerprint(forward.__code__) == wanted):
                _register(f"{module_name}.{name}", forward, "bytecode")
            else:
                logger.debug("%s.%s is not a copy of %s.forward: traced as written", module_name, name, HF_CLASS)


def registered() -> tuple[Registered, ...]:
    """The indexer classes substituted in this process (for tests and diagnostics)."""
    with _lock:
        return tuple(_registered.values())


# ----------------------------------------------------------------------------------------------
# What a graph holds (for the DSA rewrite's report)
# ----------------------------------------------------------------------------------------------
SELECTION = f"{__name__}.qsa_selection_mask"
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_THIS_FILE = os.path.abspath(__file__)


@dataclass(frozen=True)
class IndexerSite:
    """A QSA indexer's region of a graph: its module path, the model line that called it, its class and
    whether Dynamo traced it through the substitute."""

    path: str
    source: str
    cls: type
    substituted: bool


def _indexer_of(node: torch.fx.Node) -> tuple[str, type] | None:
    """(module path, class) of the QSA indexer a node was traced under, or None."""
    known = {id(r.original) for r in registered()}
    for path, cls in (node.meta.get("nn_module_stack") or {}).values():
        if not isinstance(cls, type):
            continue
        if cls.__name__.endswith("QSAIndexer") or id(getattr(cls, "forward", None)) in known:
            # the module's own path, spelled as module_path spells a node's innermost module
            return module_path(SimpleNamespace(meta={"nn_module_stack": {0: (path, cls)}})), cls
    return None


def traced_indexers(graph: torch.fx.Graph) -> list[IndexerSite]:
    """The QSA indexers in ``graph``, in graph order."""
    found: dict[str, IndexerSite] = {}
    for node in graph.nodes:
        owner = _indexer_of(node)
        if owner is None:
            continue
        frames = _FRAME.findall(node.meta.get("stack_trace") or "")
        ours = [i for i, (file, _, fn) in enumerate(frames)
                if fn == _qsa_indexer_forward.__name__ and os.path.abspath(file) == _THIS_FILE]
        callers = [f for f in frames[: ours[0]] if not is_our_file(f[0])] if ours else []
        source = f"{callers[-1][0].rsplit('/', 1)[-1]}:{callers[-1][1]}" if callers else ""
        site = found.get(owner[0])
        if site is None or (ours and not site.substituted):
            found[owner[0]] = IndexerSite(owner[0], source or (site.source if site else ""), owner[1], bool(ours))
    return list(found.values())


def report_qsa_indexers(graph: torch.fx.Graph, rewrite: str, log) -> int:
    """Log each QSA indexer of ``graph``: rewritten into :data:`SELECTION` when Dynamo traced the substitute,
    left alone (with HF's loop, whose branch breaks the graph) otherwise. Changes nothing in the graph."""
    for site in traced_indexers(graph):
        if site.substituted:
            entry = next((r for r in registered() if r.original is getattr(site.cls, "forward", None)), None)
            details = {"module": site.cls.__name__, "recognised": entry.by if entry else "name"}
            log.rewritten.append(Rewritten(rewrite, site.path, site.source, SELECTION, details))
        else:
            log.left_alone.append(LeftAlone(rewrite, site.path, site.source,
                                            "QSA indexer traced as written (its Python loop over queries branches "
                                            "on a data-dependent block count: a graph break)"))
    return 0
