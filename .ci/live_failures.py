"""pytest plugin for device runs: write each failure's report to $OUT/failures.log as it happens,
so a run cut off by its time limit still says what failed and why (pytest prints tracebacks only at
the end). Loaded by .ci/gpu with ``-p live_failures``."""
import os


def pytest_runtest_logreport(report):
    if not report.failed:
        return
    path = os.path.join(os.environ.get("OUT", "/tmp/gpu_out"), "failures.log")
    with open(path, "a") as f:
        f.write(f"=== {report.nodeid} [{report.when}]\n{report.longreprtext[-6000:]}\n\n")
