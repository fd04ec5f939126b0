"""``python -m kda_compile.bench e2e``'s decode runner for models whose HF code binds no FLA kernels (deepseek_v32,
llama): their one HF eager baseline, the command line, the released widths and a CPU smoke run."""
from __future__ import annotations

import csv

import pytest
import torch

from kda_compile.bench.__main__ import main


def _decode_specs():
    from kda_compile.bench import e2e_deepseek_v32, e2e_llama

    return {"deepseek_v32": e2e_deepseek_v32.MODEL, "llama": e2e_llama.MODEL}


def _e2e_args(*argv):
    import argparse

    from kda_compile.bench import e2e

    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("model", ["deepseek_v32", "llama"])
def test_models_without_fla_kernels_have_the_one_hf_eager_baseline(model):
    from kda_compile.bench import e2e_hybrid

    spec = _decode_specs()[model]
    assert spec.baselines == ("hf_eager",) and spec.baseline == "hf_eager"
    assert spec.configurations == ("hf_eager", "inductor", "kda_compile", "kda_compile (cuda graphs)",
                                   "kda_compile (cuda graphs; skip_decode_guards)")
    assert e2e_hybrid.bound_implementation(spec).startswith("nothing") and not e2e_hybrid.uses_fla(spec)
    for binding in ("installed", "torch"):  # nothing to bind: the same model
        with e2e_hybrid.kernel_binding(spec, binding):
            pass
    with pytest.raises(ValueError, match="binding 'fla' needs HF kernel names"):
        with e2e_hybrid.kernel_binding(spec, "fla"):
            pass
    with pytest.raises(ValueError, match="binding must be one of fla, torch, installed, got 'cuda'"):
        with e2e_hybrid.kernel_binding(spec, "cuda"):
            pass
    assert e2e_hybrid.smoke_options(spec).configs == ("hf_eager", "kda_compile", "kda_compile (cuda graphs)")


def test_models_with_fla_kernels_keep_their_two_baselines():
    from kda_compile.bench import e2e_hybrid, e2e_kimi, e2e_qwen3_next

    for spec in (e2e_kimi.MODEL, e2e_qwen3_next.MODEL):
        assert spec.baseline == "hf_eager_fla" and spec.configurations == e2e_hybrid.CONFIGURATIONS
        assert spec.prompts == (1024, 4096)
        assert e2e_hybrid.smoke_options(spec).configs == (
            "hf_eager_fla", "hf_eager_torch", "kda_compile", "kda_compile (cuda graphs)")


def test_e2e_command_line_picks_the_decode_runner():
    from kda_compile.bench.e2e import runs_decode

    assert not runs_decode(_e2e_args())  # plain --model llama: the 1B prefill benchmark
    assert not runs_decode(_e2e_args("--model", "llama", "--prompts", "1024", "--no-cache"))
    assert runs_decode(_e2e_args("--model", "llama", "--decode-shapes", "1x512,64x512"))
    assert runs_decode(_e2e_args("--model", "llama", "--smoke"))
    for model in ("kimi_linear", "qwen3_next", "deepseek_v32"):
        args = _e2e_args("--model", model)
        assert runs_decode(args) and args.decode_shapes is None  # the runner's default shapes


def test_e2e_decode_options_default_to_the_models_own():
    from kda_compile.bench import e2e_hybrid

    specs = _decode_specs()
    opts = e2e_hybrid.options_from_args(specs["deepseek_v32"], _e2e_args("--model", "deepseek_v32"))
    assert opts.prompts == () and opts.decode_shapes == ((1, 512), (1, 8192), (64, 512)) and opts.layers == 4
    assert opts.configs == specs["deepseek_v32"].configurations and opts.shape == specs["deepseek_v32"].shape
    opts = e2e_hybrid.options_from_args(specs["llama"], _e2e_args(
        "--model", "llama", "--decode-shapes", "1x512,64x512", "--prompts", "1024",
        "--configs", "hf_eager,kda_compile (cuda graphs)"))
    assert opts.prompts == (1024,) and opts.decode_shapes == ((1, 512), (64, 512))
    assert opts.configs == ("hf_eager", "kda_compile (cuda graphs)")
    smoke = e2e_hybrid.smoke_from_args(specs["llama"], _e2e_args("--model", "llama", "--smoke", "--decode-shapes",
                                                                   "2x8"))
    assert smoke.decode_shapes == ((2, 8),) and smoke.prompts == (8,) and smoke.device == "cpu"


@pytest.mark.parametrize("argv, message", [
    (["--model", "deepseek_v32", "--configs", "hf_eager_fla"],
     r"--configs for the DeepSeek-V3.2-shaped model must name configurations among hf_eager, inductor, kda_compile, "
     r"kda_compile \(cuda graphs\), kda_compile \(cuda graphs; skip_decode_guards\), got \['hf_eager_fla'\]"),
    (["--model", "llama", "--decode-shapes", "1x8", "--configs", "hf_sdpa"],
     r"--configs for the Llama-3.1-8B-shaped model must name configurations among hf_eager, .*got \['hf_sdpa'\]"),
    (["--model", "llama", "--configs", "kda_compile (cuda graphs)"],
     r"--configs for the llama prefill benchmark must name configurations among hf_eager, hf_sdpa, inductor, "
     r"kda_compile, got \['kda_compile \(cuda graphs\)'\] \(the decode configurations need --decode-shapes\)"),
    (["--model", "llama", "--decode-shapes", "1x8", "--no-cache"], r"--no-cache applies to the llama prefill"),
    (["--model", "deepseek_v32", "--prompts", "0"], r"--prompts must be comma-separated positive integers .*'0'"),
    (["--model", "deepseek_v32", "--decode-shapes", "8"], r"--decode-shapes must be .*got '8'"),
])
def test_bad_e2e_decode_options_name_what_is_accepted(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        main(["e2e", "--csv", str(tmp_path / "out.csv"), *argv])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
@pytest.mark.parametrize("argv", [["--model", "deepseek_v32"], ["--model", "llama", "--decode-shapes", "1x512"]])
def test_e2e_decode_says_it_needs_cuda(argv, tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main(["e2e", "--csv", str(tmp_path / "out.csv"), *argv])


def test_deepseek_v32_widths_are_the_released_models():
    """The benchmark's default widths are transformers' DeepseekV32Config defaults (DeepSeek-V3.2's), and 4 layers on
    the meta device are 3 dense + 1 MoE layer of about 15B parameters (30 GB in bf16: made on the GPU itself)."""
    from transformers import DeepseekV32Config

    from kda_compile.bench import e2e_deepseek_v32

    shape, defaults = e2e_deepseek_v32.Shape(), DeepseekV32Config()
    assert (shape.hidden, shape.heads, shape.q_lora_rank, shape.kv_lora_rank, shape.nope, shape.rope, shape.v) == (
        defaults.hidden_size, defaults.num_attention_heads, defaults.q_lora_rank, defaults.kv_lora_rank,
        defaults.qk_nope_head_dim, defaults.qk_rope_head_dim, defaults.v_head_dim) == (
        7168, 128, 1536, 512, 128, 64, 128)
    assert (shape.experts, shape.active_experts, shape.groups, shape.active_groups, shape.moe_intermediate,
            shape.shared_experts, shape.dense_layers, shape.dense_intermediate, shape.vocab) == (
        defaults.n_routed_experts, defaults.num_experts_per_tok, defaults.n_group, defaults.topk_group,
        defaults.moe_intermediate_size, defaults.n_shared_experts, defaults.first_k_dense_replace,
        defaults.intermediate_size, defaults.vocab_size) == (256, 8, 8, 4, 2048, 1, 3, 18432, 129280)
    assert (shape.index_topk, shape.index_heads, shape.index_head_dim) == (
        defaults.index_topk, defaults.index_n_heads, defaults.index_head_dim) == (2048, 64, 128)
    model = e2e_deepseek_v32.build_model(shape, 4, "meta", torch.bfloat16)
    assert model.config.mlp_layer_types == ["dense", "dense", "dense", "sparse"]
    assert model.config._attn_implementation == "eager" and next(model.parameters()).dtype == torch.bfloat16
    assert 15.0e9 < sum(p.numel() for p in model.parameters()) < 15.3e9


def test_llama_decode_widths_are_llama_3_1_8b():
    from kda_compile.bench import e2e_llama

    model = e2e_llama.build_model(e2e_llama.Shape(), 4, "meta", torch.bfloat16)
    config = model.config
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.intermediate_size, config.vocab_size, config.num_hidden_layers) == (
        4096, 32, 8, 128, 14336, 128256, 4)
    assert config.rope_parameters["rope_theta"] == 500000.0 and config.rope_parameters["rope_type"] == "llama3"
    assert config._attn_implementation == "eager"


def test_decode_table_without_prefill_compares_with_the_models_baseline(capsys):
    from kda_compile.bench import e2e_hybrid
    from kda_compile.bench.common import row

    spec = _decode_specs()["deepseek_v32"]
    opts = e2e_hybrid.Options(shape=spec.tiny, prompts=(), decode_shapes=((1, 8),), new_tokens=2, repeats=1,
                              configs=("hf_eager", "kda_compile (cuda graphs)"), device="cpu")
    rows = [row("deepseek_v32_decode", "hf_eager", "inference", "1x8+2", "time_per_token", "ms", (4.0, 4.0, 4.0)),
            row("deepseek_v32_decode", "kda_compile (cuda graphs)", "inference", "1x8+2", "time_per_token", "ms",
                (2.0, 2.0, 2.0))]
    summary = {"logits": {"hf_eager": {}, "kda_compile (cuda graphs)": {}},
               "tokens": {"hf_eager": {"1x8+2": [5, 6]}, "kda_compile (cuda graphs)": {"1x8+2": [5, 7]}}}
    e2e_hybrid.print_tables(spec, opts, rows, {}, summary)
    out = capsys.readouterr().out
    assert "prefill" not in out and "DeepSeek-V3.2-shaped, 4 layers ['dsa+dense', 'dsa+dense', 'dsa+dense', " \
        "'dsa+moe'], hidden 64, bfloat16. Decode: 2 greedy" in out
    assert "| x vs hf_eager | tokens equal to hf_eager |" in out
    assert "| 1x8+2 | kda_compile (cuda graphs) | 2.000 | - | - | - | - | 2.000 | 1/2 |" in out
    rows += [row("deepseek_v32_decode", "kda_compile (cuda graphs)", "inference", "1x8+2", metric, unit, (v, v, v))
             for metric, unit, v in (("gpu_time_per_token", "ms", 1.6), ("host_time_per_token", "ms", 0.5),
                                     ("kernels_per_step", "count", 100.0))]
    e2e_hybrid.print_tables(spec, opts, rows, {}, summary)
    out = capsys.readouterr().out
    assert "| wall / GPU | host ms per step | kernels per step |" in out
    assert "| 1x8+2 | kda_compile (cuda graphs) | 2.000 | 1.600 | 1.250 | 0.500 | 100 | 2.000 | 1/2 |" in out


@pytest.mark.parametrize("model", ["deepseek_v32", "llama"])
def test_e2e_decode_smoke_run_of_a_model_without_fla_kernels(model, tmp_path, capsys):
    """``e2e --model MODEL --smoke`` at tiny widths on CPU, narrowed to HF eager and CUDA-graph decode on one shape
    (seconds; the full smoke run adds kda_compile and a batch-1 shape): rows for both configurations, prefill for
    HF eager only (the CUDA-graph configuration's prefill graphs are kda_compile's), the same greedy tokens."""
    path = tmp_path / "e2e.csv"
    assert main(["e2e", "--model", model, "--smoke", "--configs", "hf_eager,kda_compile (cuda graphs)",
                 "--decode-shapes", "2x8", "--csv", str(path)]) == 0
    with path.open() as f:
        rows = list(csv.DictReader(f))
    name = _decode_specs()[model].name
    cells = {(r["op"], r["provider"], r["shape"], r["metric"]) for r in rows}
    assert cells == {(f"{name}_prefill", "hf_eager", "1x8", "time"),
                     (f"{name}_prefill", "hf_eager", "1x8", "tokens_per_s"),
                     (f"{name}_decode", "hf_eager", "2x8+2", "time_per_token"),
                     (f"{name}_decode", "kda_compile (cuda graphs)", "2x8+2", "time_per_token")}
    assert all(float(r["p50"]) > 0 for r in rows)
    out = capsys.readouterr().out
    assert "FAILED" not in out and "| x vs hf_eager |" in out
    line = next(x for x in out.splitlines() if x.startswith("| 2x8+2 | kda_compile (cuda graphs) |"))
    assert line.endswith("| 2/2 |"), line  # greedy tokens equal to HF eager's
