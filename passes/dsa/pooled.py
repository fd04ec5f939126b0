"""glm5_next's pooled DSA indexer (``Glm5NextTextIndexer.forward`` in transformers 5.23) into
``kda_compile.ops.dsa_pooled_indexer_topk`` (docs/dsa-rewrite.md, item 4).

HF's indexer builds a ``[B, S, T]`` visibility mask, ``[B, S, H_I, NP]`` pool scores (NP = T / index_kpool)
and a top-k over a boolean-indexed (data-dependent) set of pools, then expands the pools to tokens and
appends the visible tail. The whole computation is one module; its pieces are read from the module's region
of the graph (the nodes Dynamo recorded under the indexer, keyed on the modeling module as
``dsa_patterns.BLOCK_SPARSE_MODULES`` is), each by what it computes::

    packed = cache.update_indexer(cat([k, gate, valid]))    ->  split(packed, [D, D, 1], dim=-1): k, gate, valid
    scores = matmul(q.float(), pool_keys^T ...) * scale     ->  q, scale
    matmul(weights.unsqueeze(-2), relu(scores))             ->  weights
    gate + index_kpool_compress_ape.float()[None, None]     ->  ape (P = ape.shape[0])
    q_positions = (current_length - S) + arange(S)          ->  q_offset
    topk_indices.masked_fill(~attention_mask[..., None], -1).to(torch.int32)   ->  query_mask, output width
    visible_count.remainder(P) (append_visible_tail)        ->  select_tail

and the ``.to(torch.int32)`` output is replaced by the op over those inputs; everything only it used (the
visibility mask, the pool scores, the tail's gathers) is erased. The cache write stays as HF writes it.
A region that does not read as above is left alone with the reason.
"""
from __future__ import annotations

import logging
import operator
from types import SimpleNamespace

from typing import Any

import torch
import torch.fx

from kda_compile.passes.dsa.patterns import NotDSA
from kda_compile.passes.report import LeftAlone, Rewritten
from kda_compile.passes.toolkit.graph_tools import (concrete_number, describe_node, erase_unused, insert_call,
                                                    module_path, source_line, tensor_of)
from kda_compile.passes.toolkit.matching import CAST, GETITEM, MATMUL, MUL, cast_dtype

logger = logging.getLogger("kda_compile.passes.dsa_pooled")

POOLED_OP = "kda_compile.dsa_pooled_indexer_topk"
POOLED_MODULES = {"transformers.models.glm5_next.modeling_glm5_next": "Indexer"}


def pooled_regions(graph: torch.fx.Graph) -> dict[str, list[torch.fx.Node]]:
    """The pooled indexers' nodes, by the indexer's module path (graph order)."""
    regions: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        for path, cls in (node.meta.get("nn_module_stack") or {}).values():
            suffix = POOLED_MODULES.get(getattr(cls, "__module__", ""))
            if suffix and getattr(cls, "__name__", "").endswith(suffix):
                site = module_path(SimpleNamespace(meta={"nn_module_stack": {0: (path, cls)}}))
                regions.setdefault(site, []).append(node)
                break
    return regions


def _method(node: torch.fx.Node, name: str) -> bool:
    return node.op == "call_method" and node.target == name


def _is_parameter(node: Any) -> bool:
    """A module parameter as Dynamo passes it: an attribute, or a placeholder read from ``_parameters`` (a
    static cache's tensors are placeholders too, read from the cache argument)."""
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "get_attr":
        return True
    source = getattr(node, "_dynamo_source", None)
    return node.op == "placeholder" and (isinstance(node.meta.get("example_value"), torch.nn.Parameter)
                                         or "_parameters[" in str(getattr(source, "name", "")))


def _one(found: list, what: str):
    if len(found) != 1:
        raise NotDSA(f"expected one {what} in the pooled indexer, found {len(found)}")
    return found[0]


def read_pooled(nodes: list[torch.fx.Node]) -> dict:
    """The op's arguments (nodes and constants) read from one indexer's region; NotDSA says what is missing."""
    out = _one([n for n in nodes if _method(n, "to") and cast_dtype(n) == torch.int32
                and not any(u in nodes for u in n.users)], "int32 output")
    fill = out.args[0]
    if not (_method(fill, "masked_fill") and fill.args[2] == -1):
        raise NotDSA(f"the output ({describe_node(fill)}) is not masked_fill(~attention_mask[..., None], -1)")
    inv = fill.args[1]
    if not (inv.target in (operator.invert, torch.logical_not) and GETITEM.bind(inv.args[0]) is not None):
        raise NotDSA(f"the output's mask ({describe_node(inv)}) is not ~attention_mask[..., None]")
    query_mask = inv.args[0].args[0]
    width = tensor_of(out).shape[-1]

    split = _one([n for n in nodes if n.target in (torch.split, "split") and len(n.args) > 1
                  and isinstance(n.args[1], (list, tuple)) and len(n.args[1]) == 3 and n.args[1][2] == 1], "split")
    parts = {u.args[1]: u for u in split.users if GETITEM.bind(u) is not None}
    if set(parts) != {0, 1, 2}:
        raise NotDSA(f"the packed states' split ({describe_node(split)}) is not read as keys, gate, valid")

    pair = _one([n for n in nodes if MATMUL.bind(n) is not None and CAST.bind(n.args[0]) is not None
                 and tensor_of(n.args[0]) is not None and tensor_of(n.args[0]).dim() == 4], "query x pool-key matmul")
    q = pair.args[0].args[0]
    scaled = [u for u in pair.users if MUL.bind(u) is not None]
    scale = 1.0
    if scaled:
        other = scaled[0].args[1] if scaled[0].args[0] is pair else scaled[0].args[0]
        scale = float(concrete_number(other))
    head_sum = _one([n for n in nodes if MATMUL.bind(n) is not None and _method(n.args[0], "unsqueeze")
                     and tensor_of(n.args[0].args[0]) is not None and tensor_of(n.args[0].args[0]).dim() == 3],
                    "head-weight matmul")
    weights = head_sum.args[0].args[0]

    ape_cast = _one([n for n in nodes if CAST.bind(n) is not None and _is_parameter(n.args[0])
                     and tensor_of(n.args[0]) is not None and tensor_of(n.args[0]).dim() == 2], "pool position bias")
    ape = ape_cast.args[0]
    pool = int(tensor_of(ape).shape[0])

    aranges = [n for n in nodes if n.target is torch.arange]
    offsets = [n for n in nodes if n.target in (operator.add, torch.add) and len(n.args) == 2 and n.args[1] in aranges
               and not (isinstance(n.args[0], torch.fx.Node) and tensor_of(n.args[0]) is not None)]
    q_offset = _one(offsets, "query positions (current_length - S + arange(S))").args[0]

    select_tail = any(_method(n, "remainder") for n in nodes)
    topk = width - (pool - 1 if select_tail else 0)
    return dict(out=out, q=q, split=parts, weights=weights, ape=ape, query_mask=query_mask, scale=scale,
                q_offset=q_offset, topk=int(topk), select_tail=select_tail, pool=pool)


def replace_pooled(graph: torch.fx.Graph, site: dict, op) -> dict:
    """Insert the op before HF's output, reroute its users, erase what only HF's selection used."""
    out = site["out"]
    # the flags as they lie in the cache rows (the op reads nonzero as valid, as HF's .bool() does)
    valid = insert_call(graph, out, "squeeze", (site["split"][2], -1), meta_from=out)
    kwargs = dict(scale=site["scale"], key_valid=valid, query_mask=site["query_mask"], q_offset=site["q_offset"],
                  select_tail=site["select_tail"])
    new = insert_call(graph, out, op, (site["q"], site["split"][0], site["weights"], site["split"][1], site["ape"],
                                       site["topk"]), kwargs, meta_from=out)
    out.replace_all_uses_with(new)
    erase_unused(graph, [out])
    qv = tensor_of(site["q"])
    return dict(heads=int(qv.shape[2]), head_dim=int(qv.shape[3]), pool=site["pool"], topk=site["topk"],
                select_tail=site["select_tail"], scale=round(site["scale"], 6),
                width=str(tensor_of(new).shape[-1]))


def rewrite_pooled_indexers(graph: torch.fx.Graph, op, rewrite: str, log) -> int:
    """Rewrite every glm5_next pooled indexer in ``graph``; each is logged as rewritten or left alone."""
    done = 0
    for path, nodes in pooled_regions(graph).items():
        where = source_line(nodes[-1])
        try:
            if op is None:
                raise NotDSA("kda_compile.ops has no dsa_pooled_indexer_topk")
            site = read_pooled(nodes)
            details = replace_pooled(graph, site, op)
        except (NotDSA, TypeError, ValueError) as exc:
            log.left_alone.append(LeftAlone(rewrite, path, where, f"pooled indexer kept as written: {exc}"))
            logger.info("pooled indexer %s left alone: %s", path, exc)
            continue
        log.rewritten.append(Rewritten(rewrite, path, where, POOLED_OP, details))
        done += 1
    return done
