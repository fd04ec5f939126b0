"""Run-time compiled CUDA kernels: NVRTC to a cubin, the driver API to load and launch it (ctypes).

For kernels Triton cannot express (Hopper warpgroup MMA schedules). No compiler toolkit is needed:
NVRTC ships with PyTorch's CUDA wheels, the driver with the GPU. Ops layer: nothing here knows about
models or torch.compile. Compiled modules are cached per (source, kernel, device) in the process, and the
cubins on disk across processes (``cached_cubin``; ``KDA_COMPILE_CACHE_DIR``).

Errors are raised as ``NvrtcUnavailable`` (no NVRTC / driver library, compile failure) so callers can
fall back with the reason logged.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import importlib.resources
import logging
import os
import posixpath
import re
import struct
import sys
import tempfile
import threading

import torch

from kda_compile.ops import envs

logger = logging.getLogger("kda_compile.ops")

_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
# cuTensorMapEncodeTiled's enums (cuda.h): 16-bit elements (copied bit for bit), no interleave, 128-byte
# swizzle, 256-byte L2 promotion, out-of-bounds elements filled with zeros.
_TMA_UINT16, _TMA_INTERLEAVE_NONE, _TMA_SWIZZLE_128B, _TMA_L2_256B, _TMA_OOB_ZERO = 1, 0, 3, 3, 0


class NvrtcUnavailable(RuntimeError):
    """Run-time CUDA compilation cannot be used here (the message says why)."""


def _open_first(candidates) -> ctypes.CDLL:
    errors = []
    for name in candidates:
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(f"{name}: {exc}")
    raise NvrtcUnavailable("; ".join(errors) or "no candidate library")


@functools.lru_cache(maxsize=None)
def nvrtc_library() -> ctypes.CDLL:
    """libnvrtc: PyTorch's own lookup when it has one, else the nvidia wheels and the loader path."""
    try:
        from torch.cuda import _utils as cuda_utils

        finder = getattr(cuda_utils, "_get_gpu_rtc_library", None) or getattr(cuda_utils, "_get_nvrtc_library", None)
        if finder is not None:
            return finder()
    except Exception as exc:  # noqa: BLE001 - any failure here means "try the other places"
        logger.debug("torch's NVRTC lookup failed: %s", exc)
    wheel_dirs = [os.path.join(p, "nvidia") for p in sys.path if os.path.isdir(os.path.join(p, "nvidia"))]
    found = sorted({f for d in wheel_dirs for f in glob.glob(os.path.join(d, "**", "libnvrtc.so*"), recursive=True)
                    if "builtins" not in f})
    return _open_first(found + ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"])


@functools.lru_cache(maxsize=None)
def driver_library() -> ctypes.CDLL:
    lib = _open_first(["libcuda.so.1", "libcuda.so"])
    lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
    lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [
        ctypes.c_uint, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    lib.cuTensorMapEncodeTiled.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p,
                                           u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib


def _check_driver(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        driver_library().cuGetErrorString(result, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: CUDA driver error {result} ({(name.value or b'?').decode()})")


_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.MULTILINE)


@functools.lru_cache(maxsize=None)
def cuda_source(package: str, filename: str) -> str:
    """The text of the CUDA source ``filename`` shipped beside the modules of ``package`` (package data).

    Local includes (``#include "name.cuh"``, resolved beside the including file; a leading ``../`` steps up to the
    parent package, so helpers shared by several ops' kernels live in one package) are inlined, each file once,
    so NVRTC compiles one self-contained translation unit and the on-disk cubin cache keys on the full text.
    System includes (``<...>``) are left to NVRTC. A missing file raises FileNotFoundError naming it."""
    return _inline_includes(package, filename, set())


def _resolve_include(package: str, folder: str, name: str) -> tuple[str, str]:
    """The (package, path) of ``#include "name"`` written in ``folder`` of ``package``: each leading ``../`` beyond
    the package's own folder moves to its parent package."""
    path = posixpath.normpath(posixpath.join(folder, name))
    while path.startswith("../"):
        parent = package.rpartition(".")[0]
        if not parent:
            raise FileNotFoundError(f"CUDA include {name!r} climbs above the top package {package!r}")
        package, path = parent, path[3:]
    return package, path


def _inline_includes(package: str, filename: str, seen: set) -> str:
    folder, _, name = filename.rpartition("/")
    resource = importlib.resources.files(package).joinpath(filename)
    if not resource.is_file():
        raise FileNotFoundError(f"CUDA source {filename!r} is not shipped in package {package!r}")
    key = (package, filename)
    if key in seen:
        return ""
    seen.add(key)
    text = resource.read_text(encoding="utf-8")

    def expand(match: re.Match) -> str:
        owner, included = _resolve_include(package, folder, match.group(1))
        shown = included if owner == package else f"{owner}/{included}"
        return f"// ---- {shown} ----\n" + _inline_includes(owner, included, seen)

    return _LOCAL_INCLUDE.sub(expand, text)


def compile_cubin(source: str, name: str, arch: str, options: tuple[str, ...] = ()) -> bytes:
    """Compile ``source`` for ``sm_<arch>`` (e.g. "90a") with NVRTC; the cubin bytes.

    Raises NvrtcUnavailable with NVRTC's log when compilation fails."""
    lib = nvrtc_library()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None) != 0:
        raise NvrtcUnavailable("nvrtcCreateProgram failed")
    try:
        opts = [f"--gpu-architecture=sm_{arch}", "-std=c++17", *options]
        array = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        result = lib.nvrtcCompileProgram(prog, len(opts), array)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace").strip()
        if result != 0:
            raise NvrtcUnavailable(f"NVRTC could not compile {name} for sm_{arch}:\n{text}")
        if text:
            logger.debug("NVRTC log for %s:\n%s", name, text)
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        if lib.nvrtcGetCUBIN(prog, cubin) != 0:
            raise NvrtcUnavailable(f"NVRTC produced no cubin for {name} (sm_{arch})")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _ensure_context(device_index: int) -> None:
    """Make the device's primary context (the one PyTorch uses) current in this thread if none is."""
    lib = driver_library()
    current = ctypes.c_void_p()
    _check_driver(lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if current.value is None:
        ctx = ctypes.c_void_p()
        _check_driver(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device_index), "cuDevicePrimaryCtxRetain")
        _check_driver(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


class TensorMap:
    """A TMA descriptor (the driver's 128-byte, 64-byte aligned CUtensorMap) for a kernel parameter declared
    ``const __grid_constant__`` of that size."""

    SIZE = 128

    def __init__(self):
        self._buffer = ctypes.create_string_buffer(self.SIZE + 64)
        self.address = (ctypes.addressof(self._buffer) + 63) // 64 * 64


@functools.lru_cache(maxsize=256)
def tensor_map_16bit(address: int, dims: tuple[int, ...], byte_strides: tuple[int, ...],
                     box: tuple[int, ...]) -> TensorMap:
    """The TMA descriptor of a tensor of 16-bit elements at ``address`` (innermost dimension first: ``dims``
    elements, ``byte_strides`` of the outer dimensions) copied in ``box`` tiles into 128-byte swizzled
    shared memory, zeros past the ends. Cached: a decode loop asks for the same few every step.

    Raises NvrtcUnavailable when the driver rejects the layout (alignment, stride or box limits)."""
    rank = len(dims)
    tmap = TensorMap()
    result = driver_library().cuTensorMapEncodeTiled(
        ctypes.c_void_p(tmap.address), _TMA_UINT16, rank, ctypes.c_void_p(address),
        (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * max(1, rank - 1))(*byte_strides),
        (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)),
        _TMA_INTERLEAVE_NONE, _TMA_SWIZZLE_128B, _TMA_L2_256B, _TMA_OOB_ZERO)
    if result != 0:
        raise NvrtcUnavailable(f"cuTensorMapEncodeTiled rejected dims {dims}, byte strides {byte_strides}, box {box} "
                               f"(CUDA driver error {result})")
    return tmap


class CompiledKernel:
    """One kernel of a loaded cubin on one device, launched on PyTorch's current stream."""

    def __init__(self, cubin: bytes, name: str, device_index: int, shared_bytes: int):
        lib = driver_library()
        self._cu_launch = lib.cuLaunchKernel
        self.device_index = device_index
        self.shared_bytes = shared_bytes
        with torch.cuda.device(device_index):
            _ensure_context(device_index)
            self._module = ctypes.c_void_p()
            _check_driver(lib.cuModuleLoadData(ctypes.byref(self._module), cubin), f"loading {name}")
            self._func = ctypes.c_void_p()
            _check_driver(lib.cuModuleGetFunction(ctypes.byref(self._func), self._module, name.encode()),
                          f"finding {name}")
            if shared_bytes > 48 * 1024:
                _check_driver(lib.cuFuncSetAttribute(self._func, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                     shared_bytes), f"setting {name}'s shared memory")

    def launch(self, grid: tuple[int, int, int], threads: int, args: list) -> None:
        """Launch with ``args`` already as ctypes values (c_void_p, c_longlong, c_int, c_float) or
        ``TensorMap``s; the caller has made ``device_index`` PyTorch's current device."""
        ensure_thread_context(self.device_index)
        # addressof, not cast(pointer(a)): the same address, without two ctypes objects per argument (a prefill
        # launches about twenty arguments per kernel; host time is the cost of small calls)
        params = (ctypes.c_void_p * len(args))(*[
            a.address if isinstance(a, TensorMap) else ctypes.addressof(a) for a in args])
        self.launch_block(grid, threads, params, current_raw_stream(self.device_index))

    def launcher(self, grid: tuple[int, int, int], threads: int, block: "ArgumentBlock") -> "PreparedLaunch":
        """This kernel's launch over ``grid`` with ``block``'s parameters, made once and called per launch."""
        return PreparedLaunch(self, grid, threads, block)

    def launch_block(self, grid: tuple[int, int, int], threads: int, params, stream: int) -> None:
        """Launch with a prepared parameter array (``ArgumentBlock.array``, or the array ``launch`` builds) on the
        raw ``stream``; the caller has made this kernel's device current (``ensure_thread_context``)."""
        _check_driver(self._cu_launch(self._func, grid[0], grid[1], grid[2], threads, 1, 1, self.shared_bytes, stream,
                                      params, None), "cuLaunchKernel")


class ArgumentBlock:
    """A kernel's parameter list kept from launch to launch: the array of parameter addresses that
    ``cuLaunchKernel`` reads, over one 64-bit slot per pointer parameter (first) and one ctypes value per scalar
    (set once). ``set_pointers`` rewrites every pointer slot of a call with one ``struct.pack_into``: no new
    ctypes objects and no attribute store per slot. Not thread-safe: a caller shares one between threads under a
    lock."""

    def __init__(self, pointer_count: int, scalars: list):
        self._pointers = (ctypes.c_uint64 * max(1, pointer_count))()
        self._scalars = list(scalars)  # kept alive: the array holds their addresses
        base = ctypes.addressof(self._pointers)
        addresses = [base + 8 * i for i in range(pointer_count)] + [ctypes.addressof(v) for v in self._scalars]
        self.array = (ctypes.c_void_p * len(addresses))(*addresses)
        self._pack = struct.Struct(f"={pointer_count}Q").pack_into

    def set_pointers(self, addresses) -> None:
        """Every pointer parameter, in order, takes these device addresses (ints)."""
        self._pack(self._pointers, 0, *addresses)


class PreparedLaunch:
    """One kernel's launch with its grid, block, shared memory and ``ArgumentBlock`` fixed: calling it with a raw
    stream handle launches through a ``cuLaunchKernel`` binding without ``argtypes``, on ctypes values made once,
    so a call converts no Python values (``CompiledKernel.launch_block`` converts eleven per call; what remains is
    mostly the driver's launch time). The caller has made the kernel's device current and holds the block's
    lock."""

    def __init__(self, kernel: "CompiledKernel", grid: tuple[int, int, int], threads: int, block: ArgumentBlock):
        launch = driver_library()["cuLaunchKernel"]  # a new function object: the shared one has argtypes
        launch.restype = ctypes.c_int
        self._launch, self._block = launch, block
        self._stream = ctypes.c_void_p()
        self._args = (kernel._func, *(ctypes.c_uint(n) for n in (*grid, threads, 1, 1, kernel.shared_bytes)),
                      self._stream, block.array, None)

    def __call__(self, stream: int) -> None:
        self._stream.value = stream
        result = self._launch(*self._args)
        if result:
            _check_driver(result, "cuLaunchKernel")


_thread_state = threading.local()


def ensure_thread_context(device_index: int) -> None:
    """``_ensure_context`` once per thread and device (the check itself is a driver call)."""
    done = getattr(_thread_state, "devices", None)
    if done is None:
        done = _thread_state.devices = set()
    if device_index not in done:
        _ensure_context(device_index)
        done.add(device_index)


def _stream_by_module(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


# The handle of PyTorch's current stream on a device (what ``torch.cuda.current_stream(i).cuda_stream`` returns),
# through the direct binding Inductor's generated code uses where the build has it.
current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _stream_by_module


CACHE_DIR_ENV = envs.CACHE_DIR  # where compiled cubins are kept across processes; "" switches it off
_ELF_MAGIC = b"\x7fELF"


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    if nvrtc_library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
        raise NvrtcUnavailable("nvrtcVersion failed")
    return major.value, minor.value


def cubin_cache_dir() -> str | None:
    """The folder of the on-disk cubin cache: ``$KDA_COMPILE_CACHE_DIR/nvrtc``, by default under
    ``$XDG_CACHE_HOME`` (``~/.cache``) ``/kda_compile``; None when ``KDA_COMPILE_CACHE_DIR`` is set empty."""
    root = envs.cache_dir()
    return os.path.join(root, "nvrtc") if root else None


def _cache_path(source: str, name: str, arch: str, options: tuple[str, ...]) -> str | None:
    folder = cubin_cache_dir()
    if folder is None:
        return None
    digest = hashlib.sha256("\0".join([source, name, arch, *options, repr(nvrtc_version())]).encode()).hexdigest()
    return os.path.join(folder, f"{name}-sm_{arch}-{digest[:24]}.cubin")


def cached_cubin(source: str, name: str, arch: str, options: tuple[str, ...] = ()) -> tuple[bytes, str | None]:
    """``compile_cubin``'s result through the on-disk cache: ``(cubin, path it was read from or None)``. A cubin
    is kept per (source, kernel, arch, options, NVRTC version), so a fresh process skips NVRTC (about a second per
    kernel); the cache is written atomically, and a folder that cannot be read or written only costs the compile."""
    path = _cache_path(source, name, arch, options)
    if path is not None:
        try:
            with open(path, "rb") as f:
                cubin = f.read()
            if cubin.startswith(_ELF_MAGIC):
                return cubin, path
        except OSError:
            pass
    cubin = compile_cubin(source, name, arch, options)
    if path is not None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(cubin)
            os.replace(tmp, path)
        except OSError as exc:
            logger.debug("cubin cache not written (%s): %s", path, exc)
    return cubin, None


def forget_cached_cubin(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


_cache: dict[tuple, CompiledKernel] = {}
_cache_lock = threading.Lock()


def load_kernel(source: str, name: str, device_index: int, *, arch: str, shared_bytes: int) -> CompiledKernel:
    """The compiled kernel for (source, name, device), compiled (or read from the on-disk cache, ``cached_cubin``)
    and loaded on first use in the process."""
    key = (source, name, device_index, arch, shared_bytes)
    with _cache_lock:
        kernel = _cache.get(key)
        if kernel is None:
            cubin, path = cached_cubin(source, name, arch)
            try:
                kernel = CompiledKernel(cubin, name, device_index, shared_bytes)
            except RuntimeError:
                if path is None:
                    raise
                logger.warning("the cached cubin %s did not load; compiling %s again", path, name)
                forget_cached_cubin(path)
                kernel = CompiledKernel(compile_cubin(source, name, arch), name, device_index, shared_bytes)
            _cache[key] = kernel
            logger.debug("%s %s for sm_%s on cuda:%d", "loaded cached" if path else "compiled", name, arch,
                         device_index)
        return kernel
