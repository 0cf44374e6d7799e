"""The compiled CPU form of the block-scaled wire passes (``blockscale_cpu.c``, FP8's two formats and E2M1): built on
first use into one library, loaded through ctypes.

torch has no fused FP8 or E2M1 quantizer for CPU tensors, and its FP8 conversions go element by element, so the
plain-torch paths (``torch_wire``, ``torch_fp4``) take about ten passes over memory where the Triton kernel takes one. A
gloo job on CPUs then spends longer in the passes than on the link the format was chosen for. The C source does each
pass in one sweep, with the kernels' integer rounding and the same float32 operations in the same order, so their bits
are the kernels'. The library is compiled the way Triton compiles its own launchers: the system's C compiler (``$CC``,
else ``cc``, ``gcc`` or ``clang``), once per machine and source, into ``$XDG_CACHE_HOME/ddp-triton/native`` (a private
temporary folder, removed once loaded, where that is not a folder of this user's that only this user and root can
change). Flags that would change a result are not used, nor a compiler's fast-math default (``-fno-fast-math``, no FMA
contraction: ``-ffp-contract=off``); ``-fno-trapping-math`` only lets the compiler vectorise branch-free selects. A
built library is recorded with its SHA-256 and loaded only from the same open file whose bytes match it.

No compiler, a failed build or ``DDP_TRITON_NATIVE_CPU=0`` leaves the torch paths in place, with one warning for the
first two. ``cpu_fp8`` and ``cpu_fp4`` also check each format's passes against the torch passes' on first use and
fall back on a mismatch.
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
from typing import Dict, List, Optional, Tuple

import torch

#: Set to 0 to keep CPU tensors on the plain-torch FP8 and E2M1 paths.
ENV_SWITCH = "DDP_TRITON_NATIVE_CPU"
#: Compiled into one library (one build, one load, one warning): every block-scaled format's passes, in one file.
SOURCES = (Path(__file__).with_name("blockscale_cpu.c"),)
#: Never a flag that changes a value: see the module's docstring.
FLAGS = ["-O3", "-fno-fast-math", "-ffp-contract=off", "-fno-trapping-math", "-fPIC", "-shared"]
#: Tried first, where the compiler takes it: vector instructions of this machine (the cache key names the machine).
NATIVE_FLAGS = ["-march=native"]
COMPILE_TIMEOUT_S = 120
#: The cached library's name: ``<name>-<key>.so``, the key a digest of the sources, compiler, flags and machine.
LIBRARY_NAME = "wire_cpu"
#: The formats whose passes the library exports (``ddpt_quantize_<name>``, ...): FP8's two and E2M1.
FORMAT_NAMES = ("e4m3", "e5m2", "e2m1")


@dataclass(frozen=True)
class WirePasses:
    """The three passes of one block-scaled format, as C functions taking addresses (``tensor.data_ptr()``); the
    same arguments in every format, rows of the format's size.

    - ``quantize(src, src_offset, table, n_rows, scale, apply_scale, residual_or_None, residual_bf16, rows)``:
      float32 src holding the bucket from element ``src_offset`` on, ``table`` a layout's int64 (start, length)
      rows, the residual float32 or (``residual_bf16`` 1) bfloat16;
    - ``reduce(received, rows_per_rank, n_ranks, residual_or_None, residual_bf16, out)``;
    - ``dequantize(rows, table, n_rows, dst, dst_offset, canonical_nan)``: float32 dst from ``dst_offset`` on.
    """

    quantize: ctypes._CFuncPtr
    reduce: ctypes._CFuncPtr
    dequantize: ctypes._CFuncPtr


def enabled() -> bool:
    """Whether the compiled passes may be used (``DDP_TRITON_NATIVE_CPU`` is not 0); read whenever a
    call is built for new tensors."""
    return os.environ.get(ENV_SWITCH, "1").strip() != "0"


@functools.lru_cache(maxsize=None)
def library() -> Optional[Dict[str, WirePasses]]:
    """The compiled passes by format name ("e4m3", "e5m2", "e2m1"), built or found in the cache; None where they
    cannot be built (warned once)."""
    flushing_before = _flushes_subnormals()
    try:
        lib = _load()
    except (OSError, _BuildError) as exc:
        warnings.warn(f"ddp_triton: the compiled CPU wire passes are unavailable ({exc}); CPU tensors take the "
                      f"plain-torch FP8 and E2M1 paths, which are several times slower (set {ENV_SWITCH}=0 to silence "
                      "this)", RuntimeWarning, stacklevel=2)
        return None
    if _flushes_subnormals() and not flushing_before:  # a compiler whose defaults link fast-math's start-up code
        warnings.warn(f"ddp_triton: loading the compiled CPU wire passes turned on flush-to-zero for this process "
                      f"(the C compiler's defaults); they are not used. Set {ENV_SWITCH}=0, or CC to another "
                      "compiler, and restart: this process's float math stays changed", RuntimeWarning, stacklevel=2)
        return None
    address, size = ctypes.c_void_p, ctypes.c_int64
    passes = {}
    for name in FORMAT_NAMES:
        quantize = getattr(lib, f"ddpt_quantize_{name}")
        quantize.argtypes = [address, size, address, size, ctypes.c_float, ctypes.c_int, address, ctypes.c_int,
                             address]
        reduce = getattr(lib, f"ddpt_reduce_{name}")
        reduce.argtypes = [address, size, size, address, ctypes.c_int, address]
        dequantize = getattr(lib, f"ddpt_dequantize_{name}")
        dequantize.argtypes = [address, address, size, address, size, ctypes.c_int]
        for fn in (quantize, reduce, dequantize):
            fn.restype = None
        passes[name] = WirePasses(quantize, reduce, dequantize)
    return passes


def _flushes_subnormals() -> bool:
    """Whether float32 subnormals are flushed to zero in this thread (fast-math start-up code sets that)."""
    return float(torch.tensor([2.0 ** -140]).mul(1.0)[0]) == 0.0


class _BuildError(Exception):
    pass


def _compiler() -> str:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        found = shutil.which(candidate) if candidate else None
        if found:
            return found
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


def _trusted_folder(path: Path) -> bool:
    """``path`` is a folder of this user's that nobody else may write to, and no folder above it lets another user
    swap what lies below (each is root's or this user's, and writable by others only with the sticky bit, as /tmp):
    what is checked there is what is loaded."""
    real = Path(os.path.realpath(path))
    try:
        info = os.lstat(real)
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        return False
    for parent in real.parents:
        try:
            info = os.lstat(parent)
        except OSError:
            return False
        if info.st_uid not in (0, os.geteuid()) or (info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX):
            return False
    return True


def _cache_folder() -> Tuple[Path, bool]:
    """(folder, temporary): ``$XDG_CACHE_HOME/ddp-triton/native`` (else ``~/.cache/...``) where it is a trusted
    folder; otherwise (no home, read-only, another owner, writable by others) a new private temporary folder,
    removed once the library is loaded."""
    try:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddp-triton" / "native"
        base.mkdir(parents=True, exist_ok=True, mode=0o700)
    except (OSError, RuntimeError, KeyError):  # Path.home() raises these where no home directory is known
        base = None
    if base is not None and _trusted_folder(base):
        return base, False
    return Path(tempfile.mkdtemp(prefix="ddp-triton-native-")), True


def _load() -> ctypes.CDLL:
    """Load the library of this source, compiler and machine from the cache, building it there first where no
    verified copy is found. Verified: a regular file of this user's, no link, nobody else may write to it, and its
    bytes have the SHA-256 recorded beside it when it was built (a file cut short by a crash would crash the loader).
    What is verified is what is loaded: the same open file."""
    for source in SOURCES:
        if not source.is_file():
            raise _BuildError(f"{source} is missing from the installation")
    compiler = _compiler()
    sources = [source.read_bytes() for source in SOURCES]
    version = _compiler_version(compiler)
    key = hashlib.sha256(b"\0".join([*sources, compiler.encode(), version.encode(), " ".join(FLAGS).encode(),
                                     _machine_text().encode()])).hexdigest()[:20]
    folder, temporary = _cache_folder()
    target = folder / f"{LIBRARY_NAME}-{key}.so"
    try:
        fd = _open_verified(target)
        if fd is None:
            _build(compiler, folder, target)
            fd = _open_verified(target)
            if fd is None:
                raise _BuildError(f"{target} changed between its build and its load")
        try:
            where = f"/proc/self/fd/{fd}"
            return ctypes.CDLL(where if os.path.exists(where) else str(target))  # CDLL: a call releases the GIL
        finally:
            os.close(fd)
    finally:
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)  # a loaded library needs no file


def _digest_path(target: Path) -> Path:
    return target.with_suffix(".sha256")


def _read_private(path: Path) -> Optional[Tuple[int, bytes]]:
    """(open descriptor, contents) of a regular file of this user's that nobody else may write to; None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        os.close(fd)
        return None
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    return fd, b"".join(chunks)


def _open_verified(target: Path) -> Optional[int]:
    """An open descriptor of ``target`` if it is verified (see ``_load``), else None."""
    digest = _read_private(_digest_path(target))
    if digest is None:
        return None
    os.close(digest[0])
    library_file = _read_private(target)
    if library_file is None:
        return None
    fd, contents = library_file
    if hashlib.sha256(contents).hexdigest().encode() != digest[1].strip():
        os.close(fd)
        return None
    return fd


def _write_new(folder: Path, prefix: str, suffix: str, contents: Optional[bytes]) -> str:
    """A new private file in ``folder`` (flushed to disk), for an atomic rename; ``contents`` None: left empty."""
    handle, partial = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=folder)
    try:
        if contents is not None:
            os.write(handle, contents)
            os.fsync(handle)
    finally:
        os.close(handle)
    return partial


def _build(compiler: str, folder: Path, target: Path) -> None:
    """Compile into ``target`` (and its recorded SHA-256), each renamed into place whole, flushed to disk first."""
    errors: List[str] = []
    for extra in (NATIVE_FLAGS, []):
        partial = _write_new(folder, f".{LIBRARY_NAME}-", ".so", None)
        try:
            try:
                out = subprocess.run([compiler, *FLAGS, *extra, "-o", partial, *map(str, SOURCES)],
                                     capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError) as exc:
                raise _BuildError(f"{compiler} failed to run: {exc}") from exc
            if out.returncode == 0:
                os.chmod(partial, 0o700)
                with open(partial, "rb") as built:
                    contents = built.read()
                    os.fsync(built.fileno())
                digest = _write_new(folder, f".{LIBRARY_NAME}-", ".sha256",
                                    hashlib.sha256(contents).hexdigest().encode())
                os.replace(partial, target)  # atomic; replaces a link at the target rather than writing through
                os.replace(digest, _digest_path(target))
                return
            lines = (out.stderr or out.stdout).strip().splitlines()
            errors.append(lines[-1] if lines else f"exit status {out.returncode}")
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    raise _BuildError(f"{compiler} could not build {', '.join(s.name for s in SOURCES)}: {errors[-1]}")
