"""safe_write: outputs are new paths or regular files, written by temp file + rename; nothing else is touched.

Tier: no device (files, links, FIFOs and, where we may make them, device nodes in tmp_path).
"""

from __future__ import annotations

import os
import stat

import pytest

from ddp_triton.safe_write import OutputError, atomic_write_text, check_writable_folder, check_writable_target


def _char_device(path):
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 7))  # /dev/full's numbers, in the test's own folder
    except (PermissionError, AttributeError, OSError) as e:
        pytest.skip(f"cannot make a device node here: {e}")
    return path


def _make(kind, t):
    p = t / "target"
    if kind == "symlink-to-file":
        (t / "real").write_text("keep\n")
        p.symlink_to("real")
    elif kind == "dangling-symlink":
        p.symlink_to("nothing")
    elif kind == "symlink-to-dir":
        (t / "dir").mkdir()
        p.symlink_to("dir")
    elif kind == "directory":
        p.mkdir()
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "char-device":
        _char_device(p)
    elif kind == "under-a-file":
        (t / "file").write_text("x")
        p = t / "file" / "target"
    elif kind == "under-a-dangling-symlink":
        (t / "gone").symlink_to("nowhere")
        p = t / "gone" / "sub" / "target"
    elif kind == "trailing-slash":
        return str(t / "new") + os.sep
    return p


def _tree(t):
    out = {}
    for dirpath, dirnames, filenames in os.walk(t):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[p] = (stat.S_IFMT(st.st_mode), os.readlink(p) if stat.S_ISLNK(st.st_mode) else
                      open(p, "rb").read() if stat.S_ISREG(st.st_mode) else st.st_rdev)
    return out


KINDS = {"symlink-to-file": "symbolic link", "dangling-symlink": "symbolic link", "symlink-to-dir": "symbolic link",
         "directory": "directory", "fifo": "FIFO", "char-device": "character device",
         "under-a-file": "not a directory", "under-a-dangling-symlink": "symbolic link to nothing",
         "trailing-slash": "directory"}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_refused_by_name_and_nothing_touched(kind, tmp_path):
    target = _make(kind, tmp_path)
    before = _tree(tmp_path)
    with pytest.raises(OutputError) as info:
        check_writable_target(target)
    assert KINDS[kind] in str(info.value) and str(target).rstrip(os.sep) in str(info.value)
    with pytest.raises(OutputError, match=KINDS[kind]):
        atomic_write_text(target, "new\n")
    assert _tree(tmp_path) == before  # no temp file, no replaced link or node


def test_new_file_and_missing_folders(tmp_path):
    p = tmp_path / "a" / "b" / "x.txt"
    check_writable_target(p)
    assert not (tmp_path / "a").exists()  # checking creates nothing
    assert atomic_write_text(p, "hello\n") == p
    assert p.read_text() == "hello\n" and os.listdir(p.parent) == ["x.txt"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o666 & ~umask


def test_replacing_keeps_mode_and_replaces_by_rename(tmp_path):
    p = tmp_path / "x.txt"
    p.write_text("old\n")
    os.chmod(p, 0o604)
    os.link(p, tmp_path / "other")
    atomic_write_text(p, "new\n")
    assert p.read_text() == "new\n" and (tmp_path / "other").read_text() == "old\n"
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o604
    assert sorted(os.listdir(tmp_path)) == ["other", "x.txt"]


def test_a_symlinked_folder_is_fine(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "via").symlink_to("real")
    atomic_write_text(tmp_path / "via" / "x.txt", "ok\n")
    assert (tmp_path / "real" / "x.txt").read_text() == "ok\n"


def test_folder_check(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="is not a directory"):
        check_writable_folder(tmp_path / "f" / "sub")
    check_writable_folder(tmp_path / "new" / "deeper")  # creatable
    assert not (tmp_path / "new").exists()


def test_a_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    p = tmp_path / "x.txt"
    p.write_text("old\n")

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OutputError, match="No space left"):
        atomic_write_text(p, "new\n")
    monkeypatch.undo()
    assert p.read_text() == "old\n" and os.listdir(tmp_path) == ["x.txt"]
