"""``python -m kda_compile.bench e2e --train``: the training-step benchmark's command line, a CPU smoke run whose
kda_compile step must give HF's loss and gradients, and the fresh worker process that measures a cold first step."""
from __future__ import annotations

import csv

import pytest
import torch

from kda_compile.bench.__main__ import main


def _qwen3_next():
    from kda_compile.bench import e2e_qwen3_next

    return e2e_qwen3_next.MODEL


def test_train_configurations_and_their_defaults():
    from kda_compile.bench import e2e_train

    spec = _qwen3_next()
    assert e2e_train.train_configurations(spec) == ("hf_eager_fla", "hf_eager_torch", "kda_compile")
    assert e2e_train.parse_train_configs(None, spec) == ("hf_eager_fla", "kda_compile")
    assert e2e_train.parse_train_configs(None, spec, smoke=True) == ("hf_eager_torch", "kda_compile")
    with pytest.raises(SystemExit, match="must name configurations among hf_eager_fla, hf_eager_torch, kda_compile"):
        e2e_train.parse_train_configs("kda_compile (cuda graphs)", spec)


@pytest.mark.parametrize("argv, message", [
    (["--decode-shapes", "1x8"], "--decode-shapes belong to the prefill / decode runs"),
    (["--prompts", "8"], "--prompts belong to the prefill / decode runs"),
    (["--train-tokens", "0"], "--train-tokens must be comma-separated positive integers"),
])
def test_train_refuses_options_it_would_ignore(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        main(["e2e", "--model", "qwen3_next", "--train", "--smoke", *argv, "--csv", str(tmp_path / "t.csv")])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_train_says_it_needs_cuda(tmp_path):
    with pytest.raises(SystemExit, match="training benchmark needs a CUDA device"):
        main(["e2e", "--model", "kimi_linear", "--train", "--csv", str(tmp_path / "t.csv")])


@pytest.mark.slow
def test_train_smoke_run_gives_hf_loss_and_gradients(tmp_path, capsys):
    """The CPU smoke run (tiny Qwen3-Next, float32, kda_compile on aot_eager): both configurations write their
    rows, and kda_compile's first step has HF torch path's loss and gradient norm (fp32: within 1e-4)."""
    from kda_compile.bench import e2e_train

    spec = _qwen3_next()
    opts = e2e_train.TrainOptions(shape=spec.tiny, tokens=(12,), configs=("hf_eager_torch", "kda_compile"), steps=1,
                                  device="cpu", dtype=torch.float32, compiler="aot_eager",
                                  fresh_process=False)
    rows, results, failures = e2e_train.measure(spec, opts)
    assert not failures, failures
    ours, hf = results[("kda_compile", 12)], results[("hf_eager_torch", 12)]
    for key in ("loss", "grad_norm"):
        assert abs(ours[key] - hf[key]) <= 1e-4 * abs(hf[key]), (key, ours[key], hf[key])
    assert torch.isfinite(torch.tensor([ours["loss"], ours["grad_norm"]])).all() and hf["grad_norm"] > 0
    cells = {(r["op"], r["provider"], r["mode"], r["shape"], r["metric"]) for r in rows}
    for name in opts.configs:
        assert {("qwen3_next_train", name, "train", "1x12", m) for m in ("first_step_time", "time_per_step")} <= cells
    e2e_train.print_table(spec, opts, results, failures)
    out = capsys.readouterr().out
    assert "training step" in out and "grad norm rel. diff" in out


@pytest.mark.slow
def test_the_cli_smoke_run_writes_the_train_rows(tmp_path):
    path = tmp_path / "train.csv"
    assert main(["e2e", "--model", "qwen3_next", "--train", "--smoke", "--configs", "hf_eager_torch",
                 "--train-tokens", "8", "--csv", str(path)]) == 0
    with path.open() as f:
        metrics = {(r["provider"], r["shape"], r["metric"]) for r in csv.DictReader(f)}
    assert {("hf_eager_torch", "1x8", "first_step_time"), ("hf_eager_torch", "1x8", "time_per_step")} <= metrics


@pytest.mark.slow
def test_a_cold_first_step_runs_in_a_fresh_process_with_empty_caches():
    from kda_compile.bench import e2e_train

    spec = _qwen3_next()
    opts = e2e_train.TrainOptions(shape=spec.tiny, steps=1, device="cpu", dtype=torch.float32,
                                  compiler="aot_eager")
    result = e2e_train.measure_in_fresh_process(spec, "hf_eager_torch", 8, opts, timeout=600)
    assert result["first_step_time"] > 0 and len(result["time_per_step"]) == 3
    assert result["gpu_time_per_step"] is None and result["loss"] > 0
    argv = e2e_train._worker_argv(spec, "hf_eager_torch", 8, opts)
    assert argv[1:4] == ["-m", "kda_compile.bench.e2e_train", "--worker"] and '"tiny": true' in argv[4]


def test_a_failing_worker_names_its_last_line(monkeypatch):
    import subprocess

    from kda_compile.bench import e2e_train

    def fake_run(command, **kwargs):
        assert kwargs["env"]["TRITON_CACHE_DIR"].endswith("triton") and "TORCHINDUCTOR_CACHE_DIR" in kwargs["env"]
        return subprocess.CompletedProcess(command, 1, stdout="", stderr="Traceback\ntorch.OutOfMemoryError: CUDA")

    monkeypatch.setattr(e2e_train.subprocess, "run", fake_run)
    spec = _qwen3_next()
    opts = e2e_train.TrainOptions(shape=spec.tiny, device="cpu")
    with pytest.raises(RuntimeError, match="kda_compile at T=8 failed: torch.OutOfMemoryError: CUDA"):
        e2e_train.measure_in_fresh_process(spec, "kda_compile", 8, opts)
