"""Cold start of the KDA prefill (``python -m kda_compile.bench kda --modes cold_start``): the first call of each gate
form and provider in a fresh process whose Triton cache is empty, as on a fresh machine.

Each measurement runs in its own subprocess with ``TRITON_CACHE_DIR`` and ``KDA_COMPILE_CACHE_DIR`` (our NVRTC
cubins) set to a new empty folder (so no compiled kernel and no autotuning result is reused) and times, from an
idle GPU, one call of the provider on the first comparison shape: compiling, autotuning and the call itself.
Imports and the inputs' allocation are outside the interval. A process that does not finish within the time
limit is recorded as that limit with the status ``timeout`` in the log.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile

logger = logging.getLogger("kda_compile.bench")

METRIC = "first_call_time"
TIMEOUT_S = 300.0

# Runs in the fresh process: argv = gate, provider, shape; prints the seconds of the first call.
_SCRIPT = """
import sys, time
import torch
from kda_compile.bench import kda_providers as kp
gate, provider, shape = sys.argv[1:4]
x = kp.make_inputs(kp.parse_shapes(shape)[0], "cuda")
call = kp.CALLS[provider](x, gate)
torch.cuda.synchronize()
start = time.perf_counter()
call()
torch.cuda.synchronize()
print(f"FIRST_CALL_S {time.perf_counter() - start:.6f}")
"""


def first_call_seconds(*argv: str, script: str = _SCRIPT, timeout: float = TIMEOUT_S) -> tuple[float, str]:
    """``(seconds, status)`` of the first call in a fresh process with an empty Triton cache (``script`` run with
    ``argv``, printing ``FIRST_CALL_S <seconds>``; by default the KDA prefill's: gate, provider, shape); status
    ``ok``, ``timeout`` (seconds = the limit) or ``failed: <last line of its output>`` (seconds = NaN)."""
    with tempfile.TemporaryDirectory(prefix="kda_cold_triton_") as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache, TRITON_CACHE_AUTOTUNING="0", KDA_COMPILE_CACHE_DIR=cache)
        try:
            done = subprocess.run([sys.executable, "-c", script, *argv], env=env,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return timeout, "timeout"
    for line in done.stdout.splitlines():
        if line.startswith("FIRST_CALL_S "):
            return float(line.split()[1]), "ok"
    lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
    return float("nan"), "failed: " + (lines[-1][:200] if lines else f"exit code {done.returncode}")


def bench_cold_start(gates, providers, shape: str, rows: list, row) -> list[list]:
    """One ``first_call_time`` row per gate and provider (``row``: the benchmark's row builder); returns the
    table lines (gate, provider, seconds, status)."""
    lines = []
    for gate in gates:
        for provider in providers:
            seconds, status = first_call_seconds(gate, provider, shape)
            logger.info("cold start, %s gate, %s, %s: %.1f s (%s)", gate, provider, shape, seconds, status)
            rows.append(row("chunk_kda", provider, "cold_start", shape, METRIC, "s", (seconds,) * 3, gate=gate))
            lines.append([gate, provider, f"{seconds:.1f}", status])
    return lines
