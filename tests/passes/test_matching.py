"""The matching toolkit and graph helpers on small Dynamo graphs."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from kda_compile.passes.toolkit.graph_tools import (erase_unused, example_value, insert_call, is_inplace, known_equal,
                                                    module_path, source_line, static_int)
from kda_compile.passes.toolkit.matching import (ADD, CAST, CAT, DIV, DROPOUT, LINK, MATMUL, MUL, SOFTMAX, TANH,
                                                 Bindings, Call, Capture, Const, OneOf, Seq, Stage, cast_dtype,
                                                 match_downward, match_upward)


def dynamo_graph(fn, *args, dynamic=False) -> torch.fx.GraphModule:
    """The Dynamo FX graph of ``fn`` (with example values in node.meta), not compiled further."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=keep, fullgraph=True, dynamic=dynamic)(*args)
    return graphs[-1]


def calls(gm, family):
    return [n for n in gm.graph.nodes if family.bind(n) is not None]


def test_every_spelling_binds_to_the_same_arguments():
    def spellings(a, b):
        return torch.matmul(a, b), a @ b, a.matmul(b), torch.matmul(input=a, other=b)

    gm = dynamo_graph(spellings, torch.randn(3, 3), torch.randn(3, 3))
    bound = [MATMUL.bind(n) for n in calls(gm, MATMUL)]
    assert len(bound) == 4
    assert all((b["input"].name, b["other"].name) == (bound[0]["input"].name, bound[0]["other"].name) for b in bound)


def test_softmax_spellings_and_defaults():
    def spellings(x):
        return F.softmax(x, -1), x.softmax(dim=-1, dtype=torch.float64), torch.softmax(x, 1)

    gm = dynamo_graph(spellings, torch.randn(2, 3))
    bound = [SOFTMAX.bind(n) for n in calls(gm, SOFTMAX)]
    assert [(b["dim"], b["dtype"]) for b in bound] == [(-1, None), (-1, torch.float64), (1, None)]


def test_an_unknown_keyword_means_another_operation():
    def fn(a, b):
        return torch.add(a, b, alpha=2), torch.add(a, b)

    gm = dynamo_graph(fn, torch.randn(3), torch.randn(3))
    adds = calls(gm, ADD)
    assert len(adds) == 1 and "alpha" not in adds[0].kwargs


def test_cast_dtype_accepts_only_pure_dtype_casts():
    def casts(x, y):
        return (x.to(torch.float16), x.to(dtype=torch.bfloat16), x.float(), x.type_as(y), x.to("cpu"),
                x.to(torch.float16, copy=True))

    gm = dynamo_graph(casts, torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float16))
    found = [cast_dtype(n) for n in gm.graph.nodes if n.op == "call_method"]
    assert found == [torch.float16, torch.bfloat16, torch.float32, torch.float16, None, None]


def test_dropout_binds_functional_and_torch_spellings():
    def fn(x):
        return F.dropout(x, 0.1, False), torch.dropout(x, 0.2, train=False)

    gm = dynamo_graph(fn, torch.randn(4))
    assert [(b["p"], b["training"]) for b in map(DROPOUT.bind, calls(gm, DROPOUT))] == [(0.1, False), (0.2, False)]


def test_call_capture_const_and_commutative_operands():
    def fn(x, y):
        return 0.5 * (x + y), (x + y) * 0.5

    gm = dynamo_graph(fn, torch.randn(3), torch.randn(3))
    pattern = Call(MUL, commutative=True, input=Call(ADD, input=Capture("a"), other=Capture("b")),
                   other=Const("scale"))
    for mul in calls(gm, MUL):
        (b,) = list(pattern.matches(mul, Bindings()))
        assert b["scale"] == 0.5 and {b["a"].name, b["b"].name} == {"l_x_", "l_y_"}
        assert [n.target for n in b.nodes] == [operator.mul, operator.add]


def test_a_name_bound_twice_must_hold_the_same_value():
    def fn(x, y):
        return torch.tanh(x / 2.0) * 2.0, torch.tanh(y / 2.0) * 3.0

    gm = dynamo_graph(fn, torch.randn(3), torch.randn(3))
    softcap = Call(MUL, other=Const("cap"), input=Call(TANH, input=Call(DIV, input=Capture("x"), other=Const("cap"))))
    matched = [n for n in calls(gm, MUL) if any(softcap.matches(n, Bindings()))]
    assert len(matched) == 1


def test_seq_and_one_of():
    def fn(x, y):
        return torch.cat([x, y], dim=-1)

    gm = dynamo_graph(fn, torch.randn(2), torch.randn(2))
    (cat,) = calls(gm, CAT)
    assert any(Call(CAT, tensors=Seq(Capture("a"), Capture("b")), dim=-1).matches(cat, Bindings()))
    assert not any(Call(CAT, tensors=Seq(Capture("a")), dim=-1).matches(cat, Bindings()))
    assert any(OneOf(Call(MATMUL), Call(CAT)).matches(cat, Bindings()))


def test_match_upward_backtracks_through_commutative_stages():
    """``mask + scores``: binding the chain to the mask first fails at the anchor; the walk must
    come back and follow the other operand."""
    def fn(q, k, mask):
        return mask + (q @ k) * 0.5

    gm = dynamo_graph(fn, torch.randn(2, 3), torch.randn(3, 2), torch.randn(2, 2))
    add = calls(gm, ADD)[0]
    stages = (Stage("mask", Call(ADD, commutative=True, input=Capture(LINK), other=Capture("mask"))),
              Stage("scale", Call(MUL, commutative=True, input=Capture(LINK), other=Const("scale"))))
    found = match_upward(add, stages, Call(MATMUL, input=Capture("q"), other=Capture("k")))
    assert found and found.stages == ("mask", "scale")
    assert found.bindings["mask"].name == "l_mask_" and found.bindings["scale"] == 0.5


def test_match_upward_says_where_it_stopped():
    def fn(q, k):
        return torch.exp(q @ k) * 0.5

    gm = dynamo_graph(fn, torch.randn(2, 3), torch.randn(3, 2))
    stages = (Stage("scale", Call(MUL, commutative=True, input=Capture(LINK), other=Const("scale"))),)
    found = match_upward(calls(gm, MUL)[0], stages, Call(MATMUL, input=Capture("q"), other=Capture("k")))
    assert not found and found.stages == ("scale",) and found.stopped_at.target is torch.exp
    assert found.expected.startswith("matmul(")


def test_match_downward_needs_single_users():
    def fn(x, v):
        p = F.softmax(x, dim=-1)
        return p.float() @ v, p

    gm = dynamo_graph(fn, torch.randn(2, 2), torch.randn(2, 2))
    softmax = calls(gm, SOFTMAX)[0]
    stages = (Stage("cast", Call(CAST, input=Capture(LINK)), repeat=True),)
    found = match_downward(softmax, stages, Call(MATMUL, input=Capture(LINK), other=Capture("v")))
    assert not found and "a single user (found 2" in found.expected


def test_match_downward_through_repeated_stages():
    def fn(x, v):
        return F.softmax(x, dim=-1).double().float() @ v

    gm = dynamo_graph(fn, torch.randn(2, 2), torch.randn(2, 2))
    stages = (Stage("cast", Call(CAST, input=Capture(LINK)), repeat=True),)
    found = match_downward(calls(gm, SOFTMAX)[0], stages, Call(MATMUL, input=Capture(LINK), other=Capture("v")))
    assert found and found.stages == ("cast", "cast")


def test_known_equal_adds_no_guard():
    env = ShapeEnv()
    s0 = env.create_unbacked_symint()
    s1 = env.create_unbacked_symint()
    assert known_equal(s0 + 1 - 1, s0) and known_equal(3, 3)
    assert not known_equal(s0, s1) and not known_equal(s0, 3)
    assert static_int(s0 + 2 - s0) == 2 and static_int(s0) is None
    assert not env.guards


def test_insert_call_computes_the_example_value_and_erase_unused():
    def fn(x):
        y = x * 2.0
        z = y + 1.0
        x.add_(0.0)
        return z

    gm = dynamo_graph(fn, torch.randn(2, 3), dynamic=True)
    add = calls(gm, ADD)[0]
    new = insert_call(gm.graph, add, torch.transpose, (add.args[0], 0, 1), meta_from=add)
    assert list(example_value(new).shape)[::-1] == list(example_value(add.args[0]).shape)
    assert new.meta.get("stack_trace") == add.meta.get("stack_trace")
    method = insert_call(gm.graph, add, "sum", (new,))
    assert example_value(method).dim() == 0
    erased = erase_unused(gm.graph, [method])
    assert {n.name for n in erased} == {method.name, new.name}  # and not y, still used by z
    assert any(is_inplace(n) for n in gm.graph.nodes)  # the in-place add_ is never erased
    gm.graph.lint()


def test_is_inplace():
    def fn(x, y):
        x.mul_(2.0)
        y += 1.0
        return x.add(y)

    gm = dynamo_graph(fn, torch.randn(2), torch.randn(2))
    flags = [is_inplace(n) for n in gm.graph.nodes if n.op in ("call_method", "call_function")]
    assert flags.count(True) == 2 and flags[-1] is False


def test_site_names_come_from_the_module_stack():
    class Inner(torch.nn.Module):
        def forward(self, x):
            return F.softmax(x, -1)

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Inner(), Inner()])

        def forward(self, x):
            return self.layers[1](x)

    gm = dynamo_graph(Outer(), torch.randn(2, 2))
    softmax = calls(gm, SOFTMAX)[0]
    assert module_path(softmax) == "layers.1"
    assert source_line(softmax).startswith("test_matching.py:")


@pytest.mark.parametrize("value", [True, "x", None])
def test_const_rejects_non_numbers(value):
    assert not list(Const("c").matches(value, Bindings()))
