"""The benchmark command line on a machine without CUDA: options are parsed and checked, and a GPU
benchmark says it needs CUDA instead of failing somewhere inside; the report mode and the CSV schema of
the repository's benchmarks/."""
import csv
import importlib.util
import pathlib
import sys

import pytest
import torch

from kda_compile.bench.__main__ import main
from kda_compile.bench.common import named_choices
from kda_compile.bench.kda import prefill_shapes
from kda_compile.bench.kda_providers import Shape


def test_prefill_shapes_parse():
    assert prefill_shapes("1x8192x32, 8X1024x64") == [Shape(1, 8192, 32), Shape(8, 1024, 64)]
    assert prefill_shapes("varlen:4x512x32,VARLEN:3000+1+0x16") == [
        Shape(1, 2048, 32, (512, 512, 512, 512)), Shape(1, 3001, 16, (3000, 1, 0))]


@pytest.mark.parametrize("text", ["1x8192", "1x0x32", "axbxc", "1x8192x32,", "varlen:0+0x32", "varlen:5+x32",
                                  "varlen:4x512x32x2", "varlen:x32", "varlen:-1+3x4", "varlen:3x0x4", "varlen:3x4x0",
                                  "mixed:1x2x3"])
def test_bad_prefill_shapes_name_the_item(text, capsys):
    with pytest.raises(SystemExit):
        main(["kda", "--shapes", text])
    assert "shapes must be BxTxH items" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
@pytest.mark.parametrize("name", ["kda", "mla", "dsa"])
def test_gpu_benchmarks_say_they_need_cuda(name, tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main([name, "--csv", str(tmp_path / "out.csv")])


def test_dsa_benchmark_smoke_on_cpu(tmp_path):
    """One tiny shape through the whole DSA benchmark (our ops on the CPU path, the dense baseline)."""
    path = tmp_path / "dsa.csv"
    assert main(["dsa", "--smoke", "--modes", "fwd,fwd+bwd", "--csv", str(path)]) == 0
    with path.open() as f:
        rows = list(csv.DictReader(f))
    seen = {(r["op"], r["provider"], r["mode"], r["metric"]) for r in rows}
    for op in ("dsa_indexer", "dsa_sparse_attention"):
        for provider in ("ours", "dense torch"):
            assert (op, provider, "fwd", "time") in seen and (op, provider, "fwd", "tflops") in seen
    assert ("dsa_sparse_attention", "ours", "fwd+bwd", "time") in seen
    assert all(float(r["p50"]) > 0 for r in rows if r["metric"] == "time")


def test_kda_benchmark_smoke_on_cpu(tmp_path):
    """The KDA prefill comparison at tiny shapes on a CPU (ours only: FLA and FlashKDA need CUDA), one gate."""
    path = tmp_path / "kda.csv"
    assert main(["kda", "--smoke", "--gate", "lower_bound", "--csv", str(path)]) == 0
    with path.open() as f:
        rows = list(csv.DictReader(f))
    walls = [r for r in rows if r["metric"] == "wall_time"]
    assert {r["shape"] for r in walls} == {"1x64x2", "varlen:16+0+47x2"}
    assert all(r["provider"] == "ours" and r["gate"] == "lower_bound" and float(r["p50"]) > 0 for r in walls)
    assert {r["device"] for r in rows} == {"cpu"}


def test_profile_option_is_parsed(monkeypatch, tmp_path):
    import kda_compile.bench.kda as kda_bench

    seen = {}
    monkeypatch.setattr(kda_bench, "run", lambda args: seen.setdefault("profile", args.profile) and [])
    main(["kda", "--profile", "--csv", str(tmp_path / "out.csv")])
    assert seen == {"profile": True}


# ------------------------------------------------------------------------------------------------
# The prefill comparison (--modes prefill): options, shapes, providers, rows.
# ------------------------------------------------------------------------------------------------
def _parsed_args(monkeypatch, tmp_path, *argv):
    import kda_compile.bench.kda as kda_bench

    seen = {}
    monkeypatch.setattr(kda_bench, "run", lambda args: seen.setdefault("args", args) and [])
    main(["kda", "--csv", str(tmp_path / "out.csv"), *argv])
    return seen["args"]


def test_comparison_options_and_their_defaults(monkeypatch, tmp_path):
    from kda_compile.bench.kda import resolve_gates

    args = _parsed_args(monkeypatch, tmp_path)
    assert args.modes == ["prefill"] and args.gates is None and args.rounds == 3 and args.shapes is None
    assert resolve_gates(args) == ["lower_bound", "softplus", "softplus_strong"]
    args = _parsed_args(monkeypatch, tmp_path, "--gates", "softplus", "--rounds", "2", "--modes", "prefill,decode",
                        "--shapes", "varlen:2x8x4")
    assert (args.gates, args.rounds, args.modes) == (["softplus"], 2, ["prefill", "decode"])
    assert resolve_gates(args) == ["softplus"] and args.shapes == [Shape(1, 16, 4, (8, 8))]
    # the older modes keep their one softplus gate by default (the curated CSVs' commands)
    assert resolve_gates(_parsed_args(monkeypatch, tmp_path, "--modes", "decode")) == ["softplus"]
    assert resolve_gates(_parsed_args(monkeypatch, tmp_path, "--gate", "lower_bound", "--modes", "fwd,fwd+bwd")) \
        == ["lower_bound"]
    with pytest.raises(SystemExit, match="not both"):
        resolve_gates(_parsed_args(monkeypatch, tmp_path, "--gate", "softplus", "--gates", "lower_bound"))


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--rounds", "x"], ["--gates", "sigmoid"],
                                  ["--gates", "softplus,softplus"], ["--modes", "prefill,bwd"]])
def test_bad_comparison_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        main(["kda", *argv])
    assert "argument --" in capsys.readouterr().err


def test_issue_shapes_and_their_cu_seqlens():
    from kda_compile.bench.kda_providers import MIXED_LENGTHS, issue_shapes, make_inputs, parse_shapes

    shapes = issue_shapes()
    assert [s.label for s in shapes] == [
        "1x2048x32", "1x8192x32", "1x8192x64", "1x8192x96", "1x32768x32", "1x65536x16", "8x4096x32",
        "varlen:4x512x32", "varlen:8x1024x32", "varlen:8x1024x64", "varlen:8x1024x96", "varlen:16x2048x32",
        "varlen:64x256x32", "varlen:256x128x16", "varlen:3000+1+0+517+2048+2626x32"]
    assert all(parse_shapes(s.label) == [s] for s in shapes)  # every label is its own --shapes item
    assert shapes[6] == Shape(8, 4096, 32) and not shapes[6].varlen  # batched: no cu_seqlens
    assert shapes[7].offsets() == [0, 512, 1024, 1536, 2048] and (shapes[7].B, shapes[7].T) == (1, 2048)
    assert shapes[13].num_sequences == 256 and shapes[13].offsets()[-1] == 256 * 128
    mixed = shapes[-1]
    assert 0 in mixed.lengths and 1 in mixed.lengths and mixed.lengths == MIXED_LENGTHS
    x = make_inputs(Shape.packed(MIXED_LENGTHS, 2), "cpu")
    assert x.cu_seqlens.dtype == torch.int64 and x.cu_seqlens.tolist() == [0, 3000, 3001, 3001, 3518, 5566, 8192]
    assert torch.equal(x.cu_seqlens_cpu, x.cu_seqlens) and x.q.shape == (1, 8192, 2, 128)
    assert x.h0.shape == (6, 2, 128, 128) and x.h0.dtype == torch.float32  # [N, H, V, K]
    assert x.beta.shape == (1, 8192, 2) and x.dt_bias.shape == (256,) and x.A_log.shape == (2,)
    batch = make_inputs(Shape(3, 5, 2), "cpu")
    assert batch.cu_seqlens is None and batch.h0.shape == (3, 2, 128, 128) and batch.q.dtype == torch.bfloat16


def test_flashkda_is_skipped_with_a_reason_when_absent(monkeypatch):
    from kda_compile.bench.kda_providers import flashkda_missing, skip_reasons

    monkeypatch.setitem(sys.modules, "flash_kda", None)  # import flash_kda now raises ImportError
    why = flashkda_missing()
    assert why.startswith("not installed") and "flash_kda" in why and "flashkda_build.sh" in why
    fla_present = {"FLA": lambda: None}
    assert skip_reasons("lower_bound", missing={**fla_present, "FlashKDA": flashkda_missing}) == {"FlashKDA": why}
    assert skip_reasons("softplus", missing=fla_present) == {"FlashKDA": "n/a: lower-bound gate only"}
    monkeypatch.setitem(sys.modules, "flash_kda", _fake_flash_kda())
    assert flashkda_missing() is None
    assert skip_reasons("lower_bound", missing={**fla_present, "FlashKDA": flashkda_missing}) == {}


def test_providers_option_leaves_the_others_out_with_a_reason():
    import argparse

    from kda_compile.bench import kda
    from kda_compile.bench.kda_providers import skip_reasons

    present = {"FLA": lambda: None, "FlashKDA": lambda: None}
    assert skip_reasons("lower_bound", missing=present, selected=["ours", "FlashKDA"]) == {
        "FLA": "not selected: --providers"}
    parser = argparse.ArgumentParser()
    kda.add_arguments(parser)
    assert parser.parse_args(["--providers", "ours,FlashKDA"]).providers == ["ours", "FlashKDA"]
    assert parser.parse_args([]).providers == ["ours", "FLA", "FlashKDA"]
    for bad in ("FLA", "ours,nope", "ours,ours"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--providers", bad])


def _fake_flash_kda():
    """A stand-in ``flash_kda`` that checks its arguments against FlashKDA's documented API and computes
    with our op (same math), so a provider mapping the inputs wrongly fails or disagrees with ours."""
    import types

    from kda_compile.ops import chunk_kda

    def fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None,
            cu_seqlens=None):
        B, T, H, D = q.shape
        assert D == 128 and all(t.dtype == torch.bfloat16 and t.shape == q.shape for t in (k, v, g, out))
        assert beta.dtype == torch.bfloat16 and beta.shape == (B, T, H) and isinstance(scale, float)
        assert A_log.dtype == torch.float32 and A_log.shape == (H,)
        assert dt_bias.dtype == torch.float32 and dt_bias.shape == (H, 128) and -5 <= lower_bound <= 0
        if cu_seqlens is not None:
            assert B == 1 and cu_seqlens.dtype == torch.int64
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        for state in (initial_state, final_state):
            assert state.shape == (N, H, 128, 128) and state.dtype == torch.float32
        assert all(t.is_contiguous() for t in (q, k, v, g, beta, out, A_log, dt_bias, initial_state, final_state))
        o, final = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
                             use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                             safe_gate=True, lower_bound=lower_bound, state_v_first=True, cu_seqlens=cu_seqlens,
                             A_log=A_log, dt_bias=dt_bias.flatten())
        out.copy_(o)
        final_state.copy_(final)

    return types.SimpleNamespace(fwd=fwd)


def _run_comparison(monkeypatch, gates, shapes, calls, missing):
    """``bench_comparison`` on the CPU with stand-in timers: every call's wall time is 2 ms (p50), its
    kernels 0.5 ms in 3 launches."""
    from kda_compile.bench import kda_providers

    timed = []
    monkeypatch.setattr(kda_providers, "wall_time_quantiles",
                        lambda fn, device="cuda": timed.append(fn) or (1.0, 2.0, 3.0))
    monkeypatch.setattr(kda_providers, "kernel_times",
                        lambda fn, device_type="cuda": [("a", 2, 0.25), ("b", 1, 0.25)])
    rows = []
    tables = kda_providers.bench_comparison(gates, shapes, "cpu", rows, rounds=2, calls=calls, missing=missing)
    return rows, tables, timed


def test_comparison_rows_have_the_schema_and_the_same_math(monkeypatch):
    """Ours on the CPU (the reference math), FLA as a stand-in that adds 1% noise, FlashKDA through its
    real provider with the stand-in module: every row has the CSV schema and the gate, FlashKDA runs for the
    lower-bound gate only and agrees with ours, the mixed shape's empty and 1-token sequences included."""
    from kda_compile.bench import kda_providers
    from kda_compile.bench.common import CSV_COLUMNS, environment

    monkeypatch.setitem(sys.modules, "flash_kda", _fake_flash_kda())

    def fla_like(x, gate):
        ours = kda_providers.ours_call(x, gate)
        return lambda: tuple(t * 1.01 for t in ours())

    calls = {"ours": kda_providers.ours_call, "FLA": fla_like, "FlashKDA": kda_providers.flashkda_call}
    missing = {"FLA": lambda: None, "FlashKDA": kda_providers.flashkda_missing}
    shapes = [Shape.packed((20, 1, 0, 7), 2), Shape(2, 9, 1)]
    rows, tables, timed = _run_comparison(monkeypatch, ["lower_bound", "softplus"], shapes, calls, missing)
    assert len(timed) == 2 * (2 * 3 + 2 * 2)  # rounds x (3 providers + 2 providers per shape)
    for r in rows:
        assert tuple({**r, **environment()}) == CSV_COLUMNS
        assert r["op"] == "chunk_kda" and r["mode"] == "fwd" and r["gate"] in ("lower_bound", "softplus")
    got = {(r["gate"], r["shape"], r["provider"], r["metric"]): r for r in rows}
    label = "varlen:20+1+0+7x2"
    for provider in ("ours", "FLA", "FlashKDA"):
        assert got["lower_bound", label, provider, "wall_time"]["p50"] == 2.0
        assert got["lower_bound", label, provider, "kernel_time"]["p50"] == 0.5
        assert got["lower_bound", label, provider, "launches"]["p50"] == 3
    assert not any(k[0] == "softplus" and k[2] == "FlashKDA" for k in got)
    assert ("lower_bound", label, "ours", "rel_error_vs_ours") not in got
    assert got["lower_bound", label, "FlashKDA", "rel_error_vs_ours"]["p50"] < 1e-6
    assert got["lower_bound", "2x9x1", "FlashKDA", "final_state_rel_error_vs_ours"]["p50"] < 1e-6
    assert got["softplus", label, "FLA", "rel_error_vs_ours"]["p50"] == pytest.approx(0.01, rel=0.05)
    lb, sp = tables["lower_bound"][0], tables["softplus"][0]
    assert lb[0] == label and lb[1:6] == [2.0, 2.0, 2.0, 1.0, 1.0] and lb[-2] == "3 / 3 / 3"
    assert sp[3] == "n/a" and sp[5] == "-" and sp[4] == 1.0


def test_comparison_without_flashkda_or_with_a_failing_provider(monkeypatch, caplog):
    from kda_compile.bench import kda_providers
    from kda_compile.bench.common import format_table

    monkeypatch.setitem(sys.modules, "flash_kda", None)

    def broken(x, gate):
        def call():
            raise RuntimeError("kernel exploded")
        return call

    calls = {"ours": kda_providers.ours_call, "FLA": broken, "FlashKDA": kda_providers.flashkda_call}
    missing = {"FLA": lambda: None, "FlashKDA": kda_providers.flashkda_missing}
    with caplog.at_level("INFO", logger="kda_compile.bench.kda"):
        rows, tables, _ = _run_comparison(monkeypatch, ["lower_bound"], [Shape(1, 5, 1)], calls, missing)
    assert {r["provider"] for r in rows} == {"ours"}
    assert "provider FlashKDA skipped: not installed" in caplog.text and "kernel exploded" in caplog.text
    line = tables["lower_bound"][0]
    assert line[2] == "failed" and line[3] == "not installed" and line[4] == "-"
    assert "not installed" in format_table(kda_providers.COMPARISON_HEADERS, tables["lower_bound"])


def test_comparison_csv_feeds_the_catalogued_report(tmp_path):
    """A CSV of the comparison's rows makes the catalogued tables: both gates, ratios vs ours."""
    from kda_compile.bench.catalog import CATALOG
    from kda_compile.bench.common import row, write_csv
    from kda_compile.bench.report import build_table, read_rows

    rows = []
    for gate, providers in (("lower_bound", {"ours": 1.0, "FLA": 2.0, "FlashKDA": 0.5}),
                            ("softplus", {"ours": 1.0, "FLA": 1.5})):
        for name, ms in providers.items():
            for metric in ("wall_time", "kernel_time"):
                rows.append(row("chunk_kda", name, "fwd", "varlen:4x512x32", metric, "ms", (ms, ms, ms), gate=gate))
    write_csv([{**r, **TEST_ENV} for r in rows], tmp_path / "kda_prefill_vs_flashkda.csv")
    views = CATALOG["kda_prefill_vs_flashkda"].views
    table = build_table(read_rows(tmp_path / "kda_prefill_vs_flashkda.csv"), views[0])
    assert table.metric == "wall_time" and table.headers[:2] == ["gate", "shape"]
    assert table.ratios == {"FLA / ours": [2.0, 1.5], "FlashKDA / ours": [0.5, None]}
    assert [v.metric for v in views] == ["wall_time", "kernel_time", "rel_error_vs_ours"]


def test_kernel_times_aggregate_per_call():
    """CPU operator events stand in for CUDA kernels: two matmuls per call, three calls profiled."""
    from kda_compile.bench.common import kernel_times

    a = torch.randn(64, 64)
    times = kernel_times(lambda: (a @ a, a @ a, a + a), device_type="cpu")
    by_name = {name: (launches, ms) for name, launches, ms in times}
    assert by_name["aten::mm"][0] == 2 and by_name["aten::add"][0] == 1
    assert all(ms >= 0 for _, _, ms in times)
    assert [ms for _, _, ms in times] == sorted((ms for _, _, ms in times), reverse=True)


def test_host_profile_names_the_functions_called():
    from kda_compile.bench.common import host_profile

    def launch_like():
        return sum(range(100))

    assert "launch_like" in host_profile(lambda: launch_like(), calls=20)


def test_prefill_providers_take_turns_and_report_the_median_round(monkeypatch):
    """The timer stands in for do_bench: the rounds alternate between providers, and each quantile is
    the median over the rounds (a slow first round, as a GPU warming up, does not set the figure)."""
    import kda_compile.bench.kda as kda_bench

    calls = []
    first_round_slow = {"a": [(9.0, 10.0, 11.0), (1.0, 2.0, 3.0), (1.5, 2.5, 3.5)],
                        "b": [(7.0, 8.0, 9.0), (4.0, 5.0, 6.0), (3.0, 4.0, 5.0)]}

    def fake_quantiles(fn):
        name = fn()
        calls.append(name)
        return first_round_slow[name][sum(c == name for c in calls) - 1]

    monkeypatch.setattr(kda_bench, "time_quantiles", fake_quantiles)
    got = kda_bench._interleaved_quantiles({"a": lambda: "a", "b": lambda: "b"}, rounds=3)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert got == {"a": (1.5, 2.5, 3.5), "b": (4.0, 5.0, 6.0)}


# ------------------------------------------------------------------------------------------------
# The CSV schema and ``python -m kda_compile.bench report``.
# ------------------------------------------------------------------------------------------------
REPO_BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
TEST_ENV = {"device": "Test GPU", "versions": "torch 0.0; triton 0.0"}


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _write_tiny_csvs(folder):
    """attention.csv (a catalogued benchmark: two modes, one provider missing on one shape) and a CSV the
    catalogue does not know."""
    from kda_compile.bench.common import row, write_csv

    rows = [row("attention", "kda_compile", "fwd", "1x4096", "time", "ms", (0.9, 1.0, 1.1)),
            row("attention", "sdpa", "fwd", "1x4096", "time", "ms", (1.9, 2.0, 2.1)),
            row("attention", "kda_compile-triton", "fwd", "1x4096", "time", "ms", (3.9, 4.0, 4.1)),
            row("attention", "kda_compile", "fwd+bwd", "1x4096", "time", "ms", (2.9, 3.0, 3.1)),
            row("attention", "sdpa", "fwd+bwd", "1x4096", "time", "ms", (2.9, 3.3, 3.4)),
            row("attention", "sdpa", "fwd", "1x4096", "rel_err_vs_sdpa", "1", (0.0, 0.0, 0.0))]
    write_csv([{**r, **TEST_ENV} for r in rows], folder / "attention.csv")
    other = [row("my_op", "ours", "fwd", "8x8", "throughput", "TFLOP/s", (1.0, 2.0, 3.0), gate="softplus")]
    write_csv([{**r, **TEST_ENV} for r in other], folder / "my_bench.csv")


def test_row_takes_a_gate_and_fills_every_schema_column():
    from kda_compile.bench.common import CSV_COLUMNS, environment, row

    r = {**row("chunk_kda", "FLA", "fwd", "1x8x2", "time", "ms", (1, 2, 3), gate="lower_bound"), **environment()}
    assert tuple(r) == CSV_COLUMNS
    assert r["gate"] == "lower_bound" and r["device"] and r["versions"].startswith("torch ")


def test_report_writes_the_readme_tables_and_plots(tmp_path):
    from kda_compile.bench.report import write_report

    _write_tiny_csvs(tmp_path)
    if _has_matplotlib():
        assert main(["report", "--dir", str(tmp_path)]) == 0
        for name in ("attention", "my_bench"):
            assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        write_report(tmp_path, plots=False)  # the tables do not need matplotlib; the plots are not checked
    text = (tmp_path / "README.md").read_text()
    assert "python -m kda_compile.bench report" in text.splitlines()[2]
    assert "- Device: Test GPU" in text and "- Versions: torch 0.0; triton 0.0" in text
    assert ("| mode | shape | sdpa (ms) | kda_compile (ms) | kda_compile-triton (ms) | sdpa / kda_compile "
            "| sdpa / kda_compile-triton |") in text
    assert "| fwd | 1x4096 | 2 | 1 | 4 | 2.00x | 0.50x |" in text
    assert "| fwd+bwd | 1x4096 | 3.3 | 3 | - | 1.10x | - |" in text
    assert "rel_err" not in text  # only the catalogued views are tabulated
    assert "## my_bench (`my_bench.csv`)" in text and "| 8x8 | 2 |" in text  # uncatalogued: its first metric
    assert "![Softmax attention](attention.png)" in text


def test_report_without_matplotlib_names_the_package_and_writes_nothing(monkeypatch, tmp_path):
    _write_tiny_csvs(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(SystemExit, match=r"matplotlib.*pip install \"kda-compile\[bench\]\""):
        main(["report", "--dir", str(tmp_path)])
    assert not (tmp_path / "README.md").exists()


def test_report_rejects_a_csv_of_another_schema(tmp_path):
    (tmp_path / "old.csv").write_text("op,provider,mode,shape,metric,unit,p20,p50,p80,device,torch,triton,fla\n")
    with pytest.raises(SystemExit, match="old.csv: columns"):
        main(["report", "--dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="no CSV files"):
        main(["report", "--dir", str(tmp_path / "missing")])


def test_repository_benchmark_csvs_have_the_schema_and_an_environment():
    from kda_compile.bench.common import CSV_COLUMNS

    paths = sorted(REPO_BENCHMARKS.glob("*.csv"))
    assert paths, f"no benchmark CSVs in {REPO_BENCHMARKS}"
    for path in paths:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
        assert tuple(reader.fieldnames) == CSV_COLUMNS, path.name
        assert rows, path.name
        for r in rows:
            assert r["device"].strip() and r["versions"].strip(), f"{path.name}: {r}"
            assert r["command"].startswith("python -m kda_compile.bench "), f"{path.name}: {r}"
            float(r["p50"])  # a number


def test_rows_record_the_command_that_measured_them_without_the_csv_path():
    from kda_compile.bench.common import bench_command

    assert bench_command(["kda", "--csv", "/tmp/x.csv", "--gates", "lower_bound", "--shapes", "varlen:1+2x4"]) == (
        "python -m kda_compile.bench kda --gates lower_bound --shapes varlen:1+2x4")
    assert bench_command(["dsa", "--csv=/tmp/d.csv", "--smoke"]) == "python -m kda_compile.bench dsa --smoke"


def test_repository_benchmark_readme_is_up_to_date():
    """benchmarks/README.md is what ``python -m kda_compile.bench report`` makes of the CSVs beside it, and
    every CSV has its plot: after changing a CSV, run the report."""
    from kda_compile.bench.report import read_rows, readme_text

    csvs = {path.stem: read_rows(path) for path in sorted(REPO_BENCHMARKS.glob("*.csv"))}
    assert (REPO_BENCHMARKS / "README.md").read_text() == readme_text(csvs)
    assert all((REPO_BENCHMARKS / f"{name}.png").is_file() for name in csvs)


# ------------------------------------------------------------------------------------------------
# The GDN benchmark: a CPU smoke run (tiny shape, reference and our providers) through the CLI.
# ------------------------------------------------------------------------------------------------
def test_gdn_benchmark_smoke_run_on_cpu(tmp_path):
    from kda_compile.bench.common import CSV_COLUMNS

    out = tmp_path / "gdn.csv"
    assert main(["gdn", "--device", "cpu", "--providers", "reference,ours", "--shapes", "1x20,varlen:0+9+4",
                 "--decode-batches", "2", "--heads", "1/2", "--head-dim", "8", "--csv", str(out)]) == 0
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CSV_COLUMNS
    cells = {(r["provider"], r["mode"], r["shape"], r["metric"]) for r in rows}
    for mode, shape in (("fwd", "1x20"), ("fwd+bwd", "varlen:0+9+4"), ("decode", "2x1")):
        assert {("reference", mode, shape, "wall_time"), ("ours", mode, shape, "wall_time"),
                ("ours", mode, shape, "rel_error_vs_ours")} <= cells
    errors = [float(r["p50"]) for r in rows if r["metric"] == "rel_error_vs_ours"]
    assert len(errors) == 5 and max(errors) < 1e-5  # on CPU "ours" is the reference: same math


@pytest.mark.parametrize("argv", [["--shapes", "1x0"], ["--shapes", "varlen:0+0"], ["--heads", "3/4"],
                                  ["--providers", "ours,ours"], ["--modes", "bwd"]])
def test_bad_gdn_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        main(["gdn", *argv])
    assert "argument --" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_gdn_cold_start_runs_each_first_call_in_a_fresh_process(tmp_path):
    # The real subprocess on the CPU (our op on its reference backend): one forward and one decode step.
    import csv

    from kda_compile.bench.__main__ import main
    out = tmp_path / "gdn.csv"
    assert main(["gdn", "--device", "cpu", "--modes", "cold_start", "--providers", "ours,reference", "--shapes", "1x9",
                 "--decode-batches", "2", "--heads", "1/2", "--head-dim", "8", "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["op"], r["shape"], r["metric"]) for r in rows] == [
        ("chunk_gated_delta_rule", "1x9", "first_call_time"), ("fused_recurrent_gated_delta_rule", "2x1", "first_call_time")]
    assert all(0 < float(r["p50"]) < 60 for r in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_gdn_benchmark_says_it_needs_cuda(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main(["gdn", "--csv", str(tmp_path / "out.csv")])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_moe_benchmark_says_it_needs_cuda(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main(["moe", "--csv", str(tmp_path / "out.csv")])


def test_moe_benchmark_names_what_it_accepts():
    from kda_compile.bench import moe

    with pytest.raises(SystemExit, match="--models must name some of qwen3_next, deepseek_v32, kimi_linear"):
        named_choices("llama", tuple(moe.WIDTHS), "--models")


# ---- the KDA benchmark's cold-start mode ----------------------------------------------------------------------
def test_cold_start_runs_each_call_in_a_fresh_process_with_an_empty_triton_cache(monkeypatch):
    import os
    import subprocess

    from kda_compile.bench import cold_start

    seen = []

    def fake_run(command, env, capture_output, text, timeout):
        cache = env["TRITON_CACHE_DIR"]
        seen.append((command[-3:], os.listdir(cache), env["TRITON_CACHE_AUTOTUNING"]))
        return subprocess.CompletedProcess(command, 0, stdout="noise\nFIRST_CALL_S 2.500000\n", stderr="")

    monkeypatch.setattr(cold_start.subprocess, "run", fake_run)
    rows = []
    lines = cold_start.bench_cold_start(["lower_bound", "softplus"], ["ours", "FLA"], "1x2048x32", rows,
                                        lambda *a, **k: {"args": a, **k})
    assert [s[0] for s in seen] == [[g, p, "1x2048x32"] for g in ("lower_bound", "softplus") for p in ("ours", "FLA")]
    assert all(listing == [] and autotune_cache == "0" for _, listing, autotune_cache in seen)
    assert lines[0] == ["lower_bound", "ours", "2.5", "ok"] and len(rows) == 4
    assert rows[0]["args"][2] == "cold_start" and rows[0]["args"][4] == cold_start.METRIC


def test_cold_start_reports_timeouts_and_failures(monkeypatch):
    import math
    import subprocess

    from kda_compile.bench import cold_start

    def timing_out(command, **kwargs):
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(cold_start.subprocess, "run", timing_out)
    assert cold_start.first_call_seconds("softplus", "FLA", "1x2048x32", timeout=7.0) == (7.0, "timeout")

    def failing(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, stdout="", stderr="Traceback\nRuntimeError: no CUDA\n")

    monkeypatch.setattr(cold_start.subprocess, "run", failing)
    seconds, status = cold_start.first_call_seconds("softplus", "ours", "1x2048x32")
    assert math.isnan(seconds) and status == "failed: RuntimeError: no CUDA"


def test_cold_start_mode_defaults_to_every_gate():
    import argparse

    from kda_compile.bench import kda

    parser = argparse.ArgumentParser()
    kda.add_arguments(parser)
    args = parser.parse_args(["--modes", "cold_start"])
    assert args.modes == ["cold_start"] and kda.resolve_gates(args) == ["lower_bound", "softplus", "softplus_strong"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_block_sparse_benchmark_says_it_needs_cuda(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main(["block_sparse", "--csv", str(tmp_path / "out.csv")])


def test_block_sparse_benchmark_names_what_it_accepts_and_draws_hf_selections():
    from kda_compile.bench import block_sparse

    with pytest.raises(SystemExit, match="--shapes must name some of decode-b1, decode-b16, chunk, prefill"):
        named_choices("long", tuple(block_sparse.SHAPES), "--shapes")
    idx = block_sparse.random_selection(2, 300, 700, "cpu")  # 6 blocks of 128; query 0 sees 4 of them
    own = torch.arange(400, 700) // 128
    assert idx.shape == (2, block_sparse.GROUPS, 300, 6) and torch.equal(idx[..., 0], own.expand(2, 4, 300))
    assert ((idx == -1) | (idx <= own[:, None])).all() and (idx == -1).any()
