"""How an op chooses the kernel of a call: an ordered menu of typed kernel entries, one mechanism for every op.

An op lists its kernels in order of preference (:class:`KernelMenu`), each a :class:`Kernel` that says of a call
either nothing (it serves the call) or why not, in one of two ways:

- ``outside_design``: the call is not one the kernel is written for (another device, dtype or form). The next
  kernel is then simply the call's kernel; nothing is recorded.
- ``costlier``: the kernel could serve the call, but another one later in the menu is expected to be faster for
  it (a cost rule: few routed pairs per expert, a short query against a long cache). Only an automatic choice
  skips it; nothing is recorded.
- ``cannot_run``: the kernel is written for the call but cannot take it as it comes (a layout, a missing
  compiler, a width past its tiles). The next kernel serves and the choice is a fallback: recorded with
  ``record_fallback`` (logged once, listed by ``kda_compile.report()``, an error in strict mode).

:meth:`KernelMenu.choose` returns a :class:`Choice`: the kernel and the reasons of every kernel passed over, so
an explain function or a benchmark can say why a call runs where it runs. A kernel that is requested (an op
argument or an environment switch) serves the call or, as its caller asks, raises ``ValueError`` saying why
(``refused="raise"``: a request made in code) or is recorded as a fallback to the next kernel
(``refused="fall back"``: a process-wide switch, which must not break calls it does not fit). A kernel that
fails when launched (a compiler missing at run time) hands the call on with :meth:`KernelMenu.after_failure`.

The last kernel of a menu serves every call (a reference). Ops keep their own rules about which call each
kernel takes in their ``outside_design`` / ``cannot_run`` functions; this module owns the order, the request, the
reasons and the record. docs/kernel-choice.md lists which ops choose through a menu and how the others map onto it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from kda_compile.ops._common import arg_error, record_fallback

Problem = Callable[..., Optional[str]]
REFUSED = ("raise", "fall back")


@dataclass(frozen=True)
class Kernel:
    """One implementation an op may run. ``name``: as requests spell it ("cuda", "triton", "reference");
    ``label``: as logs and ``report()`` name it ("wgmma sparse attention kernel"). ``cannot_run`` returns the
    whole sentence recorded as the fallback's reason."""

    name: str
    label: str
    outside_design: Problem | None = None
    cannot_run: Problem | None = None
    costlier: Problem | None = None

    def cost_problem(self, *args) -> str | None:
        return None if self.costlier is None else self.costlier(*args)

    def design_problem(self, *args) -> str | None:
        return None if self.outside_design is None else self.outside_design(*args)

    def run_problem(self, *args) -> str | None:
        return None if self.cannot_run is None else self.cannot_run(*args)


@dataclass(frozen=True)
class Choice:
    """The kernel that serves a call, the ``(kernel name, why not)`` of each kernel passed over before it, and
    whether taking it was recorded as a fallback."""

    kernel: Kernel
    passed_over: tuple[tuple[str, str], ...] = ()
    fallback: bool = False

    @property
    def name(self) -> str:
        return self.kernel.name

    @property
    def reason(self) -> str | None:
        """Why the kernels before this one were not taken (None when the first preference serves)."""
        return "; ".join(f"{name}: {why}" for name, why in self.passed_over) or None


@dataclass(frozen=True)
class KernelMenu:
    """The kernels of ``op`` in order of preference; the last serves every call."""

    op: str
    kernels: tuple[Kernel, ...]

    def __post_init__(self) -> None:
        names = [k.name for k in self.kernels]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"{self.op}: a kernel menu needs distinct kernel names, got {names}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.kernels)

    def named(self, name: str) -> Kernel:
        for kernel in self.kernels:
            if kernel.name == name:
                return kernel
        raise arg_error("kernel", repr(name), f"one of {('auto', *self.names)} ({self.op})")

    def choose(self, *args, requested: str = "auto", refused: str = "raise") -> Choice:
        """The kernel of the call ``args`` (passed to every problem function), see the module docstring."""
        if refused not in REFUSED:
            raise arg_error("refused", repr(refused), f"one of {REFUSED}")
        start, passed, fallback = 0, [], False
        if requested != "auto":
            kernel = self.named(requested)
            design = kernel.design_problem(*args)
            # a cannot_run answer is already the whole recorded sentence; an outside_design one is a bare reason
            sentence = kernel.run_problem(*args) if design is None else None
            if design is None and sentence is None:
                return Choice(kernel)
            lead = f"the {kernel.label} cannot run this call: "
            if sentence is None:
                sentence = lead + design
            if refused == "raise":
                raise ValueError(f"{self.op}: the {kernel.label} was requested (kernel={requested!r}) but cannot "
                                 f"run this call: {sentence.removeprefix(lead)}")
            start = self.kernels.index(kernel) + 1
            passed.append((kernel.name, sentence))
            fallback = True
        return self._first_serving(args, start, passed, fallback)

    def after_failure(self, choice: Choice, exc: BaseException, *args) -> Choice:
        """The kernel after ``choice``'s, which failed to launch with ``exc``; recorded as a fallback."""
        passed = [*choice.passed_over, (choice.name, f"the {choice.kernel.label} could not be built: {exc}")]
        return self._first_serving(args, self.kernels.index(choice.kernel) + 1, passed, True)

    def _first_serving(self, args, start: int, passed: list[tuple[str, str]], fallback: bool) -> Choice:
        recorded = [why for _, why in passed] if fallback else []
        for kernel in self.kernels[start:]:
            design = kernel.design_problem(*args) or kernel.cost_problem(*args)
            if design is not None:
                passed.append((kernel.name, design))
                continue
            run = kernel.run_problem(*args)
            if run is not None:
                passed.append((kernel.name, run))
                recorded.append(run)
                continue
            if recorded:
                record_fallback(self.op, kernel.label, "; ".join(recorded))
            return Choice(kernel, tuple(passed), bool(recorded))
        raise RuntimeError(f"{self.op}: no kernel serves this call ({'; '.join(f'{n}: {w}' for n, w in passed)}); "
                           "the last kernel of a menu must serve every call")


def cuda_or_triton(op: str, cuda_label: str, triton_label: str, outside_design: Problem,
                   layout_problem: Problem) -> KernelMenu:
    """The menu of a CUDA kernel with a Triton twin that serves every call the CUDA one does not: a call outside
    the CUDA kernel's design runs the Triton kernel; a call it is written for but cannot take as laid out runs it
    as a recorded fallback ("the <cuda_label> cannot run this call: <why>")."""
    def cannot_run(*args) -> str | None:
        why = layout_problem(*args)
        return None if why is None else f"the {cuda_label} cannot run this call: {why}"

    return KernelMenu(op, (Kernel("cuda", cuda_label, outside_design, cannot_run), Kernel("triton", triton_label)))
