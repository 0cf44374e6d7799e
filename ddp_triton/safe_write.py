"""Writing output files the way careful tools do: never through a symlink, never onto a device or a FIFO.

Every file ddp-triton writes (a profile's ``--out``, the cache, ``--nccl-tuner-csv``, ``Topology.save``) goes
through ``atomic_write_text``: the text is written to a temporary file in the target's folder, flushed to disk and
renamed over the target, so a reader sees the old file or the new one, never half of one. A target may be a new
path (missing folders are created) or an existing regular file; anything else (a symlink, a directory, a device
such as ``/dev/full``, a FIFO, a socket) is refused with ``OutputError`` naming it, before anything is opened.
``check_writable_target`` makes the same checks without writing, so a caller with several outputs can check them
all before writing any.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import Optional, Union

PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["OutputError", "atomic_write_text", "check_writable_folder", "check_writable_target"]


class OutputError(ValueError):
    """An output path that cannot or must not be written; the message names the path and why."""

    def __init__(self, path: PathLike, reason: str):
        self.path = os.fspath(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link (not writing through it: name the file itself)"
    if stat.S_ISDIR(mode):
        return "a directory (name a file in it)"
    if stat.S_ISCHR(mode):
        return "a character device (not writing onto devices: name a regular file)"
    if stat.S_ISBLK(mode):
        return "a block device (not writing onto devices: name a regular file)"
    if stat.S_ISFIFO(mode):
        return "a FIFO (not writing into pipes: name a regular file)"
    if stat.S_ISSOCK(mode):
        return "a socket (name a regular file)"
    return "not a regular file"


def check_writable_folder(folder: PathLike, target: Optional[PathLike] = None) -> None:
    """Raise ``OutputError`` (naming ``target``, else ``folder``) unless ``folder`` is a directory we can write in or
    can be created: its nearest existing ancestor is a writable directory. Symlinks to directories are fine here
    (``~/.cache`` often is one). Nothing is created."""
    folder = Path(os.fspath(folder))
    target = folder if target is None else target
    here = folder
    while True:
        try:
            st = os.stat(here)
        except (FileNotFoundError, NotADirectoryError):  # missing, or below a file: look further up
            if os.path.islink(here):
                raise OutputError(target, f"{here} is a symbolic link to nothing ({os.readlink(here)})") from None
            if here.parent == here:
                raise OutputError(target, "no existing folder above it") from None
            here = here.parent
            continue
        except OSError as e:  # ELOOP, EACCES...
            raise OutputError(target, f"cannot use folder {here}: {e.strerror or e}") from None
        break
    if not stat.S_ISDIR(st.st_mode):
        raise OutputError(target, f"{here} is not a directory")
    if not os.access(here, os.W_OK | os.X_OK):
        raise OutputError(target, f"permission denied: cannot write in {here}")


def check_writable_target(path: PathLike) -> Path:
    """Raise ``OutputError`` unless ``path`` is a new path (its folders existing or creatable) or an existing
    regular file we may replace; returns it as a Path. Nothing is created, opened or written."""
    raw = os.fspath(path)
    if not raw:
        raise OutputError(raw, "empty path")
    if raw.endswith(os.sep) or (os.altsep and raw.endswith(os.altsep)):
        raise OutputError(raw, "names a directory (name a file)")
    p = Path(raw)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        st = None  # a file on the way: check_writable_folder names it
    except OSError as e:
        raise OutputError(p, f"cannot check it: {e.strerror or e}") from None
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise OutputError(p, f"is {_kind(st.st_mode)}")
        if not os.access(p, os.W_OK, follow_symlinks=False):
            raise OutputError(p, "permission denied: the file is not writable")
    check_writable_folder(p.parent, p)
    return p


def atomic_write_text(path: PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path``: checked as ``check_writable_target`` does, written to a temporary file in
    the same folder, fsync'd, then renamed over ``path``. A replaced file keeps its permission bits (and owner, where
    allowed); a new one gets the umask's. Missing folders are created. ``OutputError`` on any failure, with no
    temporary file left behind; returns the path."""
    p = check_writable_target(path)
    try:
        old = os.lstat(p)
    except OSError:
        old = None
    folder = p.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(p, f"cannot create folder {folder}: {e.strerror or e}") from None
    data = text.encode("utf-8")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    tmp = fd = None
    for _ in range(100):
        candidate = folder / f".{p.name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(candidate, flags, 0o666)  # the umask applies, as for any new file
        except FileExistsError:
            continue
        except OSError as e:
            raise OutputError(p, f"cannot create a temporary file in {folder}: {e.strerror or e}") from None
        tmp = candidate
        break
    if fd is None or tmp is None:
        raise OutputError(p, f"cannot create a temporary file in {folder}")
    try:
        try:
            if old is not None and stat.S_ISREG(old.st_mode):
                os.fchmod(fd, stat.S_IMODE(old.st_mode))
                try:
                    os.fchown(fd, old.st_uid, old.st_gid)
                except OSError:
                    pass  # not ours to give away: the file becomes the writer's, as with any rewrite
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        # Checked again just before the rename: what is at the path now must still be a file we may replace.
        check_writable_target(p)
        os.replace(tmp, p)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise OutputError(p, f"cannot write: {e.strerror or e}") from None
        raise
    try:  # the rename itself, to disk
        dfd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return p
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
    return p
