"""``python -m kda_compile.bench cp``: the context-parallel prefill benchmark, end to end on CPU (2 gloo
processes, tiny sequence), its options and their errors, the slices and inputs of its ranks, and its report."""
from __future__ import annotations

import argparse
import csv
import math
import sys

import pytest
import torch

from kda_compile.bench.__main__ import main
from kda_compile.bench.context_parallel import add_arguments, default_world_sizes, make_plan
from kda_compile.bench.cp_worker import balanced_lengths, make_tokens, provider_name

CPU_PROVIDERS = {"ours (1 process)", "ours (CP, 2 processes)", "ours (CP, 2 processes, balanced)",
                 "ours (CP, 2 processes, no state)"}


def _read(path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_cp_benchmark_runs_end_to_end_on_cpu(tmp_path, monkeypatch, capsys):
    """Both ops on 2 gloo processes: every provider but FLA (skipped on CPU), finite positive times, the final
    state of the split run against the one-process run's, the command column, the table and the report."""
    out = tmp_path / "cp.csv"
    argv = ["cp", "--device", "cpu", "--ops", "kda,gdn", "--tokens", "256", "--reps", "3", "--warmup", "1"]
    monkeypatch.setattr(sys, "argv", ["python -m kda_compile.bench", *argv, "--csv", str(out)])
    assert main([*argv, "--csv", str(out)]) == 0
    rows = _read(out)
    for op, gate in (("chunk_kda", "lower_bound"), ("chunk_gated_delta_rule", "")):
        times = {r["provider"]: r for r in rows if r["op"] == op and r["metric"] == "wall_time"}
        assert set(times) == CPU_PROVIDERS
        for r in times.values():
            values = [float(r[q]) for q in ("p20", "p50", "p80")]
            assert all(math.isfinite(v) and v > 0 for v in values) and values == sorted(values)
            assert (r["mode"], r["gate"], r["shape"], r["unit"], r["device"]) == ("fwd", gate, "1x256x2", "ms", "cpu")
        errors = {r["provider"]: float(r["p50"]) for r in rows
                  if r["op"] == op and r["metric"] == "final_state_rel_error_vs_one_device"}
        assert set(errors) == {"ours (CP, 2 processes)", "ours (CP, 2 processes, balanced)"}
        assert max(errors.values()) < 1e-5  # float32, the same tokens in one process and split
    assert {r["command"] for r in rows} == {" ".join(["python -m kda_compile.bench", *argv])}
    table = capsys.readouterr().out
    assert "speedup vs 1" in table and "ours (CP, 2 processes, balanced)" in table

    from kda_compile.bench.report import write_report

    write_report(tmp_path, plots=False)
    readme = (tmp_path / "README.md").read_text()
    assert "Context-parallel KDA prefill" in readme
    assert "ours (1 process) / ours (CP, 2 processes, balanced)" in readme


def _args(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_and_plan():
    args = _args()
    assert (args.ops, args.tokens, args.first_rank_share, args.warmup, args.reps) == (["kda"], None, 2.0, 2, 10)
    plan = make_plan(args, 2, "/tmp/r.json")
    assert plan.tokens == (131072, 262144, 524288, 1048576) and plan.world_sizes == (2,)
    assert (plan.heads, plan.head_dim, plan.dtype) == (16, 128, torch.bfloat16)
    assert make_plan(_args("--device", "cpu"), 0, "r").tokens == (512,)
    assert _args("--op", "gdn").ops == ["gdn"] and _args("--ops", "gdn,kda").ops == ["kda", "gdn"]
    assert _args("--first-rank-share", "none").first_rank_share is None
    assert default_world_sizes(1) == [2] and default_world_sizes(2) == [2] and default_world_sizes(3) == [2]
    assert default_world_sizes(8) == [2, 4, 8]


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "0"], "argument --tokens: --tokens must be distinct positive integers"),
    (["--tokens", "1k"], "argument --tokens"),
    (["--world-sizes", "1,2"], "argument --world-sizes: --world-sizes must be 2 or more"),
    (["--first-rank-share", "-1"], "argument --first-rank-share"),
    (["--ops", "kda,mamba"], "argument --ops/--op: --ops must be distinct items of kda,gdn"),
    (["--providers", "cp,cp"], "argument --providers"),
    (["--reps", "0"], "argument --reps: --reps must be a positive integer"),
])
def test_bad_options_are_refused_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(["cp", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, devices, message", [
    (["--tokens", "1001"], 2, "--tokens 1001: not divisible by --world-sizes 2"),
    (["--tokens", "4", "--world-sizes", "8"], 8, "--tokens 4: fewer tokens than the 8 ranks"),
    (["--world-sizes", "2,4"], 2, "--world-sizes 2,4: larger than the 2 GPU(s) present; accepted: 2 to 2"),
    (["--tokens", "8", "--first-rank-share", "100"], 2, "--first-rank-share 100: leaves no token"),
    ([], 1, "--world-sizes 2: context parallelism needs 2 or more GPUs, 1 present"),
])
def test_options_that_do_not_fit_name_the_option(argv, devices, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        make_plan(_args(*argv), devices, "r")


def test_cpu_run_reports_a_layout_error_before_spawning(tmp_path):
    with pytest.raises(SystemExit, match="cp: --tokens 511: not divisible by --world-sizes 2"):
        main(["cp", "--device", "cpu", "--tokens", "511", "--csv", str(tmp_path / "x.csv")])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_says_it_needs_cuda(tmp_path):
    with pytest.raises(SystemExit, match="needs CUDA devices"):
        main(["cp", "--csv", str(tmp_path / "out.csv")])


def test_balanced_slices_give_rank_zero_its_share():
    assert balanced_lengths(131072, 2, 2.0) == (87424, 43648)  # the others' slices whole 64-token chunks
    lengths = balanced_lengths(1048576, 8, 2.0)
    assert sum(lengths) == 1048576 and lengths[1] % 64 == 0 and len(set(lengths[1:])) == 1
    assert 1.9 < lengths[0] / lengths[1] < 2.1
    assert balanced_lengths(10, 2, 1.0) == (5, 5) and balanced_lengths(512, 2, 2.0) == (384, 128)


def test_provider_names():
    assert provider_name("single", 1, "cuda") == "ours (1 GPU)"
    assert provider_name("cp", 4, "cuda") == "ours (CP, 4 GPUs)"
    assert provider_name("balanced", 2, "cpu") == "ours (CP, 2 processes, balanced)"
    assert provider_name("fla", 8, "cuda") == "FLA (CP, 8 GPUs, no state)"


@pytest.mark.parametrize("op", ["kda", "gdn"])
def test_a_rank_draws_its_slice_of_the_same_sequence(op):
    whole = make_tokens(op, 0, 20000, 2, 4, "cpu", torch.float32, seed=3)
    part = make_tokens(op, 8000, 9000, 2, 4, "cpu", torch.float32, seed=3)  # across a block boundary
    assert all(torch.equal(part[name], whole[name][:, 8000:17000]) for name in whole)
    assert whole["g"].shape == ((1, 20000, 2, 4) if op == "kda" else (1, 20000, 2))


def test_catalog_ratios_read_as_the_speedup_of_context_parallelism():
    from kda_compile.bench.catalog import CATALOG
    from kda_compile.bench.report import build_table

    def timing(provider, ms):
        return {"op": "chunk_kda", "provider": provider, "mode": "fwd", "gate": "lower_bound", "shape": "1x131072x16",
                "metric": "wall_time", "unit": "ms", "p20": ms, "p50": ms, "p80": ms}

    rows = [timing("ours (1 GPU)", "10"), timing("ours (CP, 2 GPUs)", "6"), timing("ours (CP, 2 GPUs, balanced)", "5"),
            timing("FLA (CP, 2 GPUs, no state)", "8"), timing("ours (CP, 2 GPUs, no state)", "4")]
    speedup, fla = (build_table(rows, view) for view in CATALOG["cp"].views[:2])
    assert speedup.ratios == {"ours (1 GPU) / ours (CP, 2 GPUs)": [10 / 6],
                              "ours (1 GPU) / ours (CP, 2 GPUs, balanced)": [2.0]}
    assert fla.ratios == {"FLA (CP, 2 GPUs, no state) / ours (CP, 2 GPUs, no state)": [2.0]}
