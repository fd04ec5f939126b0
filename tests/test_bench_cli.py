"""The benchmark command line on a machine without CUDA: options are parsed and checked, and a GPU
benchmark says it needs CUDA instead of failing somewhere inside."""
import pytest
import torch

from kda_compile.bench.__main__ import main
from kda_compile.bench.kda import prefill_shapes


def test_prefill_shapes_parse():
    assert prefill_shapes("1x8192x32, 8X1024x64") == [(1, 8192, 32), (8, 1024, 64)]


@pytest.mark.parametrize("text", ["1x8192", "1x0x32", "axbxc", "1x8192x32,"])
def test_bad_prefill_shapes_name_the_item(text, capsys):
    with pytest.raises(SystemExit):
        main(["kda", "--shapes", text])
    assert "shapes must be BxTxH items" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
@pytest.mark.parametrize("name", ["kda", "mla"])
def test_gpu_benchmarks_say_they_need_cuda(name, tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main([name, "--csv", str(tmp_path / "out.csv")])


def test_profile_option_is_parsed(monkeypatch, tmp_path):
    import kda_compile.bench.kda as kda_bench

    seen = {}
    monkeypatch.setattr(kda_bench, "run", lambda args: seen.setdefault("profile", args.profile) and [])
    main(["kda", "--profile", "--csv", str(tmp_path / "out.csv")])
    assert seen == {"profile": True}


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
