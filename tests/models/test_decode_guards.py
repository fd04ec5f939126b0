"""``Config(skip_decode_guards=True)``: a warm static decode step runs with only Dynamo's differentiating guards
(kda_compile/decode_guards.py), gives the tokens of the same model with every guard, and the option is refused
where it cannot apply."""
from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

import kda_compile
from kda_compile import Config, decode_guards, optimize
from kda_compile.backend import KdaCompileBackend
from tests.models.test_cuda_graph_decode import PROMPT, VOCAB, aot_eager_for_inductor, build, hf_torch_path

transformers = pytest.importorskip("transformers")
from transformers import StaticCache  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py
NEW_TOKENS = 5  # one prefill and four decode steps per generate(): the first decode step warms, three skip
ROWS = (2, 3, 2)


@contextlib.contextmanager
def recorded_skips():
    """Yields a list that gets, for each decode call run with guards skipped, whether Dynamo's stance said so
    while the call ran."""
    seen, real = [], decode_guards._skipping_stance

    @contextlib.contextmanager
    def spy():
        with real():
            seen.append(torch._dynamo.eval_frame._is_skip_guard_eval_unsafe_stance())
            yield

    with mock.patch.object(decode_guards, "_skipping_stance", spy):
        yield seen


def _generate(model, rows: int, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(3, VOCAB, (rows, PROMPT), generator=torch.Generator().manual_seed(seed))
    cache = StaticCache(config=model.config, max_cache_len=PROMPT + NEW_TOKENS)
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                          past_key_values=cache)


@pytest.mark.skipif(not decode_guards.available(), reason="this torch's set_stance has no skip_guard_eval_unsafe")
@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_warm_decode_steps_skip_guards_and_give_the_same_tokens(family):
    """Batch sizes 2, 3 and 2 again, each generate() into a static cache of its own: per generate() the first
    decode step runs every guard (batch 3 compiles its own captured graph there), the three after it run with
    the stance set, and the tokens equal those of the same model with every guard evaluated (the last call picks
    batch 2's graph though batch 3's entry was used last)."""
    model = build(family)
    with hf_torch_path(model), aot_eager_for_inductor():
        model.forward = optimize(model.forward, mode="reduce-overhead")
        expected = [_generate(model, rows) for rows in ROWS]
    del model.forward
    torch._dynamo.reset()
    with hf_torch_path(model), aot_eager_for_inductor(), recorded_skips() as skipped:
        model.forward = optimize(model.forward, Config(skip_decode_guards=True), mode="reduce-overhead")
        got = [_generate(model, rows) for rows in ROWS]
    for want, have in zip(expected, got):
        assert torch.equal(have, want)
    assert skipped == [True] * len(ROWS) * (NEW_TOKENS - 2)
    report = kda_compile.report(model.forward)
    assert sum(g.cuda_graphs.startswith("cuda graphs: captured") for g in report.graphs) == 2, str(report)
    assert "skip_decode_guards: warm CUDA-graph decode steps run with only Dynamo's differentiating guards" in str(
        report)


@pytest.mark.skipif(not decode_guards.available(), reason="this torch's set_stance has no skip_guard_eval_unsafe")
def test_a_step_under_another_mode_or_cache_runs_every_guard():
    """The key of a warm step: the cache, the batch size, grad / inference mode and the training flag."""
    warm, calls = decode_guards.WarmDecodeSteps(), []
    cache, other = StaticCache.__new__(StaticCache), StaticCache.__new__(StaticCache)
    module = torch.nn.Linear(1, 1).eval()
    ids = torch.zeros(2, 1, dtype=torch.long)

    def call():
        calls.append(torch._dynamo.eval_frame._is_skip_guard_eval_unsafe_stance())

    def step(c, **kwargs):
        warm.run(call, c, decode_guards.step_key((), {"input_ids": kwargs.get("ids", ids)}, module))

    step(cache)
    step(cache)
    step(other)
    step(cache, ids=torch.zeros(3, 1, dtype=torch.long))
    with torch.no_grad():
        step(cache)
    module.train()
    step(cache)
    module.eval()
    step(cache)
    assert calls == [False, True, False, False, False, False, True]


def test_the_option_is_refused_without_cuda_graphs():
    with pytest.raises(ValueError, match=r"skip_decode_guards=True applies to CUDA-graph decode steps: pass "
                                         r"mode='reduce-overhead'.*got mode=None"):
        optimize(torch.nn.Linear(2, 2), Config(skip_decode_guards=True))


def test_the_option_is_refused_through_torch_compile():
    fn = torch.compile(lambda x: x + 1, backend=KdaCompileBackend(Config(skip_decode_guards=True)))
    with pytest.raises(ValueError, match=r"skip_decode_guards=True is honoured by kda_compile.optimize\(\) "
                                         r"results only"):
        fn(torch.ones(2))


def test_a_torch_without_the_stance_option_is_named():
    with mock.patch.object(decode_guards, "available", return_value=False):
        with pytest.raises(ValueError, match=r"Config.skip_decode_guards needs torch.compiler.set_stance"
                                             r"\(skip_guard_eval_unsafe=...\)"):
            optimize(torch.nn.Linear(2, 2), Config(skip_decode_guards=True), mode="reduce-overhead")


def test_it_is_not_a_rewrite_switch():
    assert "skip_decode_guards" in kda_compile.config.NOT_REWRITES
    with pytest.raises(TypeError, match="Config.skip_decode_guards must be a bool"):
        Config(skip_decode_guards=1)


@pytest.mark.cuda
@pytest.mark.skipif(not decode_guards.available(), reason="this torch's set_stance has no skip_guard_eval_unsafe")
@pytest.mark.parametrize("family", ["kimi_linear", "qwen3_next", "deepseek_v32", "llama"])
def test_cuda_warm_decode_steps_replay_with_guards_skipped(family):
    """Inductor's cudagraph trees on CUDA: the decode steps with guards skipped (after each generate()'s first)
    replay the captured graphs and give the tokens of the same model with every guard, over batch 2, 3, 2."""
    model = build(family, "cuda")

    def tokens(config):
        torch._dynamo.reset()
        model.forward = optimize(original, config, mode="reduce-overhead")
        out = []
        for rows in ROWS:
            ids = torch.randint(3, VOCAB, (rows, PROMPT), generator=torch.Generator().manual_seed(rows)).cuda()
            cache = StaticCache(config=model.config, max_cache_len=PROMPT + NEW_TOKENS)
            out.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                      do_sample=False, past_key_values=cache))
        return out

    original = model.forward
    expected = tokens(Config())
    with recorded_skips() as skipped:
        got = tokens(Config(skip_decode_guards=True))
    report = kda_compile.report(model.forward)
    for want, have in zip(expected, got):
        assert torch.equal(have, want), str(report)
    assert skipped == [True] * len(ROWS) * (NEW_TOKENS - 2)
    assert report.cuda_graph_fallbacks == (), str(report)
