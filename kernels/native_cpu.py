"""The compiled CPU form of the FP8 wire passes (``fp8_cpu.c``): built on first use, loaded through ctypes.

torch has no fused FP8 quantizer for CPU tensors, and its FP8 conversions go element by element, so the plain-torch
path (``torch_wire``) takes about ten passes over memory where the Triton kernel takes one. A gloo job on CPUs then
spends longer in the FP8 passes than on the link the format was chosen for. ``fp8_cpu.c`` does each pass in one
sweep, with the kernels' integer rounding and the same float32 operations in the same order, so its bits are the
kernels'. It is compiled the way Triton compiles its own launchers: the system's C compiler (``$CC``, else ``cc``,
``gcc`` or ``clang``), once per machine and source, into ``$XDG_CACHE_HOME/ddp-triton/native`` (a private temporary
folder where that is not a folder of this user's). Flags that would change a result are not used: no fast-math, no
FMA contraction (``-ffp-contract=off``); ``-fno-trapping-math`` only lets the compiler vectorise branch-free selects.

No compiler, a failed build or ``DDP_TRITON_NATIVE_CPU=0`` leaves the torch path in place, with one warning for the
first two. ``torch_wire`` also checks the library's bits against its own on first use and falls back on a mismatch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

#: Set to 0 to keep CPU tensors on the plain-torch FP8 path.
ENV_SWITCH = "DDP_TRITON_NATIVE_CPU"
SOURCE = Path(__file__).with_name("fp8_cpu.c")
#: Never a flag that changes a value: see the module's docstring.
FLAGS = ["-O3", "-ffp-contract=off", "-fno-trapping-math", "-fPIC", "-shared"]
#: Tried first, where the compiler takes it: vector instructions of this machine (the cache key names the machine).
NATIVE_FLAGS = ["-march=native"]
COMPILE_TIMEOUT_S = 120
FORMAT_NAMES = ("e4m3", "e5m2")


@dataclass(frozen=True)
class Fp8Passes:
    """The three passes of one FP8 format, as C functions taking addresses (``tensor.data_ptr()``).

    - ``quantize(src, n, n_rows, scale, apply_scale, residual_or_None, rows)``: float32 src of an aligned layout;
    - ``reduce(received, rows_per_rank, n_ranks, residual_or_None, out)``;
    - ``dequantize(rows, n, dst, canonical_nan)``: float32 dst of an aligned layout.
    """

    quantize: ctypes._CFuncPtr
    reduce: ctypes._CFuncPtr
    dequantize: ctypes._CFuncPtr


def enabled() -> bool:
    """Whether the compiled passes may be used (``DDP_TRITON_NATIVE_CPU`` is not 0); read at every bind."""
    return os.environ.get(ENV_SWITCH, "1").strip() != "0"


@functools.lru_cache(maxsize=None)
def library() -> Optional[Dict[str, Fp8Passes]]:
    """The compiled passes by format name ("e4m3", "e5m2"), built or found in the cache; None where they cannot be
    built (warned once)."""
    try:
        path = _built_library()
        lib = ctypes.CDLL(str(path))  # CDLL, not PyDLL: a call releases the GIL
    except (OSError, _BuildError) as exc:
        warnings.warn(f"ddp_triton: the compiled CPU FP8 passes are unavailable ({exc}); CPU tensors take the "
                      f"plain-torch FP8 path, which is several times slower (set {ENV_SWITCH}=0 to silence this)",
                      RuntimeWarning, stacklevel=2)
        return None
    address, size = ctypes.c_void_p, ctypes.c_int64
    passes = {}
    for name in FORMAT_NAMES:
        quantize = getattr(lib, f"ddpt_quantize_{name}")
        quantize.argtypes = [address, size, size, ctypes.c_float, ctypes.c_int, address, address]
        reduce = getattr(lib, f"ddpt_reduce_{name}")
        reduce.argtypes = [address, size, size, address, address]
        dequantize = getattr(lib, f"ddpt_dequantize_{name}")
        dequantize.argtypes = [address, size, address, ctypes.c_int]
        for fn in (quantize, reduce, dequantize):
            fn.restype = None
        passes[name] = Fp8Passes(quantize, reduce, dequantize)
    return passes


class _BuildError(Exception):
    pass


def _compiler() -> str:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    raise _BuildError("no C compiler found ($CC, cc, gcc or clang)")


def _machine_text() -> str:
    """What the compiled code depends on besides the source and the compiler: the architecture and, for
    ``-march=native``, the CPU's feature flags."""
    text = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "model name")):
                text += "\n" + line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        pass
    return text


def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise _BuildError(f"{compiler} --version failed: {exc}") from exc


def _private(path: Path, kind: Callable[[int], bool]) -> bool:
    """``path`` is of this kind (``stat.S_ISDIR``, ``stat.S_ISREG``; never a link), this user's, and nobody else
    may write to it: safe to build into, and to load."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return kind(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022


def _cache_folder() -> Path:
    """``$XDG_CACHE_HOME/ddp-triton/native`` (else ``~/.cache/...``) where it is a private folder of this user's;
    otherwise (no home, read-only, another owner, writable by others) a new private temporary folder."""
    try:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddp-triton" / "native"
        base.mkdir(parents=True, exist_ok=True, mode=0o700)
    except (OSError, RuntimeError, KeyError):  # Path.home() raises these where no home directory is known
        base = None
    if base is not None and _private(base, stat.S_ISDIR):
        return base
    return Path(tempfile.mkdtemp(prefix="ddp-triton-native-"))


def _built_library() -> Path:
    """The library's path, compiling it into the cache when no usable copy is there."""
    if not SOURCE.is_file():
        raise _BuildError(f"{SOURCE} is missing from the installation")
    compiler = _compiler()
    source = SOURCE.read_bytes()
    version = _compiler_version(compiler)
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), version.encode(), " ".join(FLAGS).encode(),
                                     _machine_text().encode()])).hexdigest()[:20]
    folder = _cache_folder()
    target = folder / f"fp8_cpu-{key}.so"
    if _private(target, stat.S_ISREG):
        return target
    errors: List[str] = []
    for extra in (NATIVE_FLAGS, []):
        handle, partial = tempfile.mkstemp(prefix=".fp8_cpu-", suffix=".so", dir=folder)
        os.close(handle)
        try:
            out = subprocess.run([compiler, *FLAGS, *extra, "-o", partial, str(SOURCE)], capture_output=True,
                                 text=True, timeout=COMPILE_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            os.unlink(partial)
            raise _BuildError(f"{compiler} failed to run: {exc}") from exc
        if out.returncode == 0:
            os.chmod(partial, 0o700)
            os.replace(partial, target)  # atomic; replaces a link at the target rather than writing through it
            return target
        os.unlink(partial)
        lines = (out.stderr or out.stdout).strip().splitlines()
        errors.append(lines[-1] if lines else f"exit status {out.returncode}")
    raise _BuildError(f"{compiler} could not build {SOURCE.name}: {errors[-1]}")
