"""The one way qkv writes a file: to a temporary name in the same folder, flushed to disk, then
renamed over the target (``os.replace`` is atomic on POSIX and Windows), so a reader or a crash
sees the old file or the new one, never half of one.

Temporary files are named ``.<name>.<random>.tmp``; :func:`remove_stale_temporaries` clears the
ones a killed process left behind. A whole folder (a run folder, a prepared corpus) is built the
same way by :func:`atomic_folder`.

A target that is not a regular file cannot be replaced by a rename without destroying it: a
named pipe (FIFO), a character device (``/dev/null``, a terminal) or a socket, also reached
through a symbolic link (``/dev/stdout``, ``/dev/fd/N``), is opened and written in place
(:func:`is_special_file`); opening a FIFO waits for its reader, as a shell's ``>`` does. A
directory or a block device is refused. Writing such a target in place raises :class:`WriteFailed`
naming it, in one line, when the write fails (``/dev/full``: no space left).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TMP_SUFFIX = ".tmp"


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class WriteFailed(OSError, ValueError):
    """Writing an output in place failed (``/dev/full``'s "no space left", a socket that cannot be
    opened, a device's error): one line naming the target.

    An ``OSError`` (its ``errno`` is the failure's), and a ``ValueError``, so that the CLI reports
    it as a problem with the output the user named (exit 2), not as a fault of qkv.
    """


def _write_failed(path: Path, err: OSError) -> WriteFailed:
    failed = WriteFailed(f"{path}: cannot write ({err.strerror or err})")
    failed.errno = err.errno
    return failed


def _target_mode(path: Path) -> int | None:
    """The ``st_mode`` of what ``path`` names, symbolic links followed; None when nothing is there."""
    try:
        return os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None


def is_special_file(path: str | Path) -> bool:
    """Whether ``path`` (symbolic links followed) is a FIFO, a character device or a socket:
    an output that qkv writes in place, never replaces.

    Args:
        path: the output's path, e.g. ``/dev/stdout``, ``/dev/null`` or a FIFO made by ``mkfifo``.

    Returns:
        True for a FIFO, character device or socket; False for a regular file, a directory, a block
        device or nothing at all.
    """
    return _is_special(_target_mode(Path(path)))


def _is_special(mode: int | None) -> bool:
    return mode is not None and (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISSOCK(mode))


def _refuse_unwritable(path: Path, mode: int | None, option: str) -> None:
    if mode is None:
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(f"{path}: {option} names a directory, not a file")
    if stat.S_ISBLK(mode):
        raise ValueError(f"{path}: {option} names a block device; qkv writes files, pipes and character devices")


@contextmanager
def atomic_path(path: str | Path, *, mode: int = 0o644) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; when the block succeeds, flush it to disk and
    rename it onto ``path``. On an exception the temporary file is removed and ``path`` is left
    as it was.

    A FIFO, character device or socket (:func:`is_special_file`) is not replaced: ``path`` itself
    is yielded, to be opened and written in place.

    Raises:
        IsADirectoryError: ``path`` names an existing directory (checked before any work).
        ValueError: ``path`` names a block device.
        WriteFailed: writing a FIFO, device or socket in place failed (naming ``path``). (A regular
            file's errors, e.g. a full disk, are raised as they come: a run's checkpointing reports them.)
    """
    path = Path(path)
    target = _target_mode(path)
    _refuse_unwritable(path, target, "the output")
    if _is_special(target):
        try:
            yield path
        except OSError as err:
            if type(err) is OSError:  # not a subclass that already says what is wrong (BrokenPipeError, ...)
                raise _write_failed(path, err) from None
            raise
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as handle:  # whatever wrote it (torch, safetensors, matplotlib) did not fsync
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)  # mkstemp creates 0600; qkv's outputs are meant to be shared
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def check_output_file(path: str | Path, option: str = "output", *, overwrite: bool = True) -> Path:
    """Check, before any work, that ``path`` can be written as a file: not an existing directory
    or block device, and its parent is a directory (or can be made); with ``overwrite=False``, not
    an existing file either (a benchmark's result JSON, which a rerun must not replace unasked).
    A FIFO, character device or socket (``/dev/stdout``, ``/dev/null``) passes: it is written in
    place. Raises ``IsADirectoryError`` / ``NotADirectoryError`` / ``FileExistsError`` /
    ``ValueError`` naming ``option``; writes nothing."""
    path = Path(path)
    target = _target_mode(path)
    _refuse_unwritable(path, target, option)
    if _is_special(target):
        return path
    if not overwrite and (path.exists() or path.is_symlink()):
        raise FileExistsError(f"{path}: exists; pass --overwrite to replace it, or choose another {option}")
    for parent in path.resolve().parents:
        if parent.exists():
            if not parent.is_dir():
                raise NotADirectoryError(f"{path}: {option} lies under {parent}, which is a file")
            break
    return path


def write_text(path: str | Path, text: str) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically (a FIFO or device in place, see :func:`atomic_path`).
    Returns ``path``."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (a FIFO or device in place, see :func:`atomic_path`).
    Returns ``path``."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def read_json(path: str | Path) -> Any:  # a JSON value: dict, list, str, number, bool or None
    """The JSON value in the UTF-8 file ``path``. Raises ``ValueError`` naming the file in one line
    when it is not valid JSON or not UTF-8 (a missing file is the caller's message to give)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({(str(err).splitlines() or [''])[0][:200]})") from None


def write_json(path: str | Path, data: object, *, indent: int | None = 2) -> Path:
    """Write ``data`` as JSON (strict: no NaN/Infinity) atomically. Returns ``path``."""
    return write_text(path, json.dumps(data, indent=indent, allow_nan=False) + "\n")


def remove_stale_temporaries(folder: str | Path, *, recursive: bool = True) -> list[Path]:
    """Delete the ``.<name>.<random>.tmp`` files that a killed writer left in ``folder``.

    Only call this on a folder that no other process is writing to (e.g. a run folder when a run
    starts). Returns the removed paths.
    """
    folder = Path(folder)
    pattern = f"**/.*{TMP_SUFFIX}" if recursive else f".*{TMP_SUFFIX}"
    removed = []
    for path in folder.glob(pattern):
        if path.is_file() and not path.is_symlink():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


@contextmanager
def atomic_folder(out: str | Path, *, tag: str = "new") -> Iterator[Path]:
    """Yield an empty temporary folder next to ``out`` (``.<name>.<tag>-<random>``); when the
    block succeeds, put it in place of ``out``: an existing ``out`` is moved aside first and
    removed only once the new folder is there. On an exception (the block may raise to refuse an
    incomplete folder) the temporary folder is removed and ``out`` is left as it was; temporary
    folders a killed build left are removed by the next build of ``out``.

    The caller checks beforehand that ``out`` may be replaced.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.{tag}-*"):  # a build killed half-way
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.{tag}-"))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700
        if out.exists():
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def default_cache_dir() -> Path:
    """qkv's cache folder: ``$QKV_CACHE`` or ``$XDG_CACHE_HOME/qkv`` or ``~/.cache/qkv`` (downloads,
    and what qkv measures once per machine)."""
    if os.environ.get("QKV_CACHE"):
        return Path(os.environ["QKV_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "qkv"
