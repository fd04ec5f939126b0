"""``import kda_compile`` installs no import hook and no Dynamo substitute; the first ``optimize()`` call or use of
the ``kda_compile`` backend does (kda_compile/process_hooks.py). Each case runs in a fresh process."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading


PROBE = textwrap.dedent('''
    import json, sys
    import transformers.models.kimi_linear.modeling_kimi_linear  # an entry point the substitution knows
    import torch
    import kda_compile
    from kda_compile import process_hooks
    from kda_compile.passes.substitution import install as kda_substitution, registry


    def state():
        return {"installed": process_hooks.installed(), "hook": kda_substitution._watcher in sys.meta_path,
                "substituted": sorted(r.entry_point for r in registry.registered())}


    def f(x):
        return x * 2


    states = {"import": state()}
    how = sys.argv[1]
    if how == "optimize":
        compiled = kda_compile.optimize(f, kda_compile.Config(compiler="eager"))
        states["made"] = state()
    else:
        compiled = torch.compile(f, backend="kda_compile")
        states["made"] = state()
    compiled(torch.ones(3))
    states["called"] = state()
    print(json.dumps(states))
''')


def run_probe(how: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, how], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_not_installed(state: dict) -> None:
    assert state == {"installed": False, "hook": False, "substituted": []}, state


def assert_installed(state: dict) -> None:
    assert state["installed"] and state["hook"], state
    assert any("chunk_kimi_delta_attention" in entry for entry in state["substituted"]), state


def test_import_installs_nothing_and_optimize_installs_the_hooks():
    states = run_probe("optimize")
    assert_not_installed(states["import"])
    assert_installed(states["made"])  # at the optimize() call, before anything is traced
    assert_installed(states["called"])


def test_import_installs_nothing_and_the_backend_installs_the_hooks_on_first_use():
    states = run_probe("backend")
    assert_not_installed(states["import"])
    assert_not_installed(states["made"])  # torch.compile(backend="kda_compile") only wraps the function
    assert_installed(states["called"])


def test_install_is_idempotent_and_thread_safe(monkeypatch):
    from kda_compile import process_hooks
    from kda_compile.passes.substitution import install as kda_substitution

    calls = []
    monkeypatch.setattr(process_hooks, "_installed", False)
    monkeypatch.setattr(kda_substitution, "install", lambda: calls.append(1) or True)
    barrier = threading.Barrier(8)

    def racer():
        barrier.wait()
        process_hooks.install()

    threads = [threading.Thread(target=racer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    process_hooks.install()
    assert calls == [1] and process_hooks.installed()


def test_the_entry_point_alone_installs_the_hooks_on_first_use():
    """``torch.compile(..., backend="kda_compile")`` in a process that never imports kda_compile (the
    ``torch_dynamo_backends`` entry point loads it): its first call installs the hooks."""
    code = textwrap.dedent('''
        import json, sys
        import torch

        def f(x):
            return x * 2

        compiled = torch.compile(f, backend="kda_compile")
        compiled(torch.ones(3))
        hooks = sys.modules["kda_compile.process_hooks"]
        print(json.dumps({"imported_by_torch": "kda_compile" in sys.modules, "installed": hooks.installed()}))
    ''')
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"imported_by_torch": True, "installed": True}
