"""The kernel menu every op chooses its kernels with (ops/_kernel_choice.py): order of preference, the three ways a
kernel passes on a call (outside its design, costlier, cannot run) and which of them is a recorded fallback,
requested kernels that raise or fall back, a kernel that fails to launch, and the menus the ops declare."""
from __future__ import annotations

import pytest

from kda_compile.ops._common import StrictModeError, clear_fallback_events, fallback_events, strict_fallbacks
from kda_compile.ops._kernel_choice import Choice, Kernel, KernelMenu, cuda_or_triton


def _menu(**problems):
    """fast -> slow -> reference; ``problems`` maps "fast_design" etc. to the text returned for every call."""
    def said(key):
        return (lambda call: problems[key] if call in problems.get(f"{key}_calls", (call,)) else None) \
            if key in problems else None

    return KernelMenu("toy_op", (
        Kernel("fast", "fast kernel", outside_design=said("fast_design"), cannot_run=said("fast_run"),
               costlier=said("fast_cost")),
        Kernel("slow", "slow kernel", cannot_run=said("slow_run")),
        Kernel("reference", "torch reference"),
    ))


@pytest.fixture(autouse=True)
def _fresh_record():
    clear_fallback_events()
    yield
    clear_fallback_events()


def _recorded():
    return [(e.op, e.chosen, e.reason) for e in fallback_events()]


def test_the_first_kernel_that_serves_takes_the_call_and_nothing_is_recorded():
    choice = _menu().choose("call")
    assert choice.name == "fast" and choice.reason is None and not choice.fallback and _recorded() == []


def test_outside_design_and_costlier_pass_the_call_on_without_a_record():
    choice = _menu(fast_design="float64 inputs").choose("call")
    assert (choice.name, choice.reason, choice.fallback) == ("slow", "fast: float64 inputs", False)
    choice = _menu(fast_cost="few rows: the slow kernel reads less").choose("call")
    assert choice.name == "slow" and choice.reason == "fast: few rows: the slow kernel reads less"
    assert _recorded() == []


def test_a_kernel_that_cannot_run_a_call_it_is_written_for_is_a_recorded_fallback():
    choice = _menu(fast_run="the fast kernel cannot run this call: rows not aligned",
                   slow_run="no Triton here").choose("call")
    assert choice.name == "reference" and choice.fallback
    assert _recorded() == [("toy_op", "torch reference",
                            "the fast kernel cannot run this call: rows not aligned; no Triton here")]
    with strict_fallbacks(), pytest.raises(StrictModeError, match="toy_op would run the torch reference"):
        _menu(slow_run="no Triton here").choose("call", requested="slow", refused="fall back")


def test_a_requested_kernel_serves_or_raises_or_falls_back_as_asked():
    menu = _menu(fast_cost="a cost rule", fast_design="float64 inputs", fast_design_calls=("f64",))
    assert menu.choose("call", requested="fast").name == "fast"  # a cost rule binds only an automatic choice
    with pytest.raises(ValueError, match=r"toy_op: the fast kernel was requested \(kernel='fast'\) but cannot run "
                                         r"this call: float64 inputs"):
        menu.choose("f64", requested="fast")
    choice = menu.choose("f64", requested="fast", refused="fall back")
    assert choice.name == "slow" and choice.fallback
    assert _recorded() == [("toy_op", "slow kernel", "the fast kernel cannot run this call: float64 inputs")]
    assert menu.choose("call", requested="reference").name == "reference"


def test_a_requested_kernel_that_cannot_run_is_recorded_in_its_own_sentence():
    """A ``cannot_run`` answer is the whole sentence: a request that falls back records it once, and a request
    that raises names the bare reason."""
    menu = _menu(fast_run="the fast kernel cannot run this call: rows not aligned")
    assert menu.choose("call", requested="fast", refused="fall back").name == "slow"
    assert _recorded() == [("toy_op", "slow kernel", "the fast kernel cannot run this call: rows not aligned")]
    with pytest.raises(ValueError, match=r"toy_op: the fast kernel was requested \(kernel='fast'\) but cannot run "
                                         r"this call: rows not aligned$"):
        menu.choose("call", requested="fast")


def test_bad_requests_and_menus_name_the_argument():
    with pytest.raises(ValueError, match=r"kernel must be one of \('auto', 'fast', 'slow', 'reference'\)"):
        _menu().choose("call", requested="cutlass")
    with pytest.raises(ValueError, match="refused must be one of"):
        _menu().choose("call", refused="ignore")
    with pytest.raises(ValueError, match="distinct kernel names"):
        KernelMenu("toy_op", (Kernel("a", "a"), Kernel("a", "b")))


def test_a_kernel_that_fails_to_launch_hands_the_call_on_recorded():
    menu = _menu()
    choice = menu.after_failure(menu.choose("call"), RuntimeError("no NVRTC here"), "call")
    assert choice.name == "slow" and choice.fallback
    assert _recorded() == [("toy_op", "slow kernel", "the fast kernel could not be built: no NVRTC here")]


def test_a_menu_whose_last_kernel_refuses_says_so():
    menu = KernelMenu("toy_op", (Kernel("only", "only kernel", outside_design=lambda call: "never"),))
    with pytest.raises(RuntimeError, match="the last kernel of a menu must serve every call"):
        menu.choose("call")


def test_a_cuda_kernel_with_a_triton_twin_records_only_layout_problems():
    menu = cuda_or_triton("toy_op", "wgmma kernel", "Triton kernel",
                          lambda design, layout: design, lambda design, layout: layout)
    assert menu.choose(None, None).name == "cuda"
    assert menu.choose("not sm_90", None).name == "triton" and _recorded() == []
    assert menu.choose(None, "rows not aligned").name == "triton"
    assert _recorded() == [("toy_op", "Triton kernel", "the wgmma kernel cannot run this call: rows not aligned")]
    assert isinstance(menu.choose(None, None), Choice)


def test_the_ops_menus_end_with_a_kernel_that_serves_every_call():
    from kda_compile.ops.dsa import kernels as dsa_kernels
    from kda_compile.ops.dsa.indexer import wgmma_indexer
    from kda_compile.ops.dsa.pooled import cuda_keys
    from kda_compile.ops.dsa.sparse import wgmma_forward
    from kda_compile.ops.block_sparse import custom_ops as block_sparse
    from kda_compile.ops.moe import choice as moe_choice
    from kda_compile.ops.mla import path_choice
    from kda_compile.ops.mla.decode import kernels as mla_decode

    menus = [path_choice.FORMS, mla_decode.MENU, dsa_kernels.INDEXER, dsa_kernels.POOLED_INDEXER, dsa_kernels.SPARSE_ATTENTION,
             dsa_kernels.SPARSE_ATTENTION_BACKWARD, wgmma_indexer.MENU, wgmma_forward.MENU, cuda_keys.MENU,
             moe_choice.MENU, block_sparse.FORWARD, block_sparse.BACKWARD]
    for menu in menus:
        last = menu.kernels[-1]
        assert last.outside_design is None and last.cannot_run is None and last.costlier is None, menu.op
