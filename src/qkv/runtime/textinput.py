"""Reading the text a user gives qkv, one line at a time, with a bound on a line's length.

Every command that reads sentences (``qkv translate``, ``qkv embed``, ``qkv attend --corpus``,
``qkv evaluate --src/--ref``, ``qkv train --train-src/--train-tgt``) reads them here, from a file
or from standard input:

* a line is read up to :data:`MAX_LINE_BYTES` bytes (1 MiB: far beyond any sentence a model takes,
  far below what would exhaust memory); a longer one, e.g. ``/dev/zero`` or a binary file given by
  mistake, is refused in one line naming the file and line number after reading that much, never
  read whole;
* a file is read as a stream, a line at a time, so a file is never held whole in memory as bytes
  beside its lines;
* what may be read is anything that opens as a stream: a regular file, a named pipe (FIFO),
  ``/dev/stdin``, a shell's process substitution (``<(zcat corpus.gz)``, a ``/dev/fd/N`` path), a
  character device. A directory, a missing file and a file the user may not read are each refused in
  one line saying which. A FIFO that no process holds open for writing reads as empty at once
  rather than waiting for a writer that may never come.
"""

from __future__ import annotations

import gzip
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

MAX_LINE_BYTES = 1 << 20  # 1 MiB of UTF-8 in one line (the newline aside)
STDIN_NAME = "<stdin>"


def check_input_file(path: str | Path, what: str = "file") -> os.stat_result:
    """Check that ``path`` can be opened for reading, before any work, and say in one line why not.

    Args:
        path: the file (symbolic links followed).
        what: what the file is, for the messages (``"input file"``, ``"weights file"``, ...).

    Returns:
        The file's ``os.stat`` result.

    Raises:
        FileNotFoundError: nothing is there (``{path}: no such {what}``).
        IsADirectoryError: ``path`` is a directory.
        NotADirectoryError: a part of ``path`` before its end is a file.
        PermissionError: the user may not read the file (or search a folder on its way).
    """
    path = Path(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such {what}") from None
    except NotADirectoryError:
        raise NotADirectoryError(f"{path}: no such {what} (a part of the path is a file, not a folder)") from None
    except PermissionError:
        raise PermissionError(f"{path}: permission denied (a folder on the way cannot be searched)") from None
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(f"{path}: is a directory; a {what} is needed")
    if not os.access(path, os.R_OK):
        raise PermissionError(f"{path}: permission denied (the {what} cannot be read by this user)")
    return info


def open_input(path: str | Path, what: str = "file", *, decompress: bool = False) -> BinaryIO:
    """Open ``path`` to read its bytes as a stream (see the module's notes for what may be read).

    A FIFO is opened without waiting for a writer: one that no process holds open for writing
    reads as empty at once.

    Args:
        path: a regular file, FIFO, ``/dev/stdin``, ``/dev/fd/N`` or character device.
        what: what the file is, for the messages.
        decompress: a name ending in ``.gz`` is read through gzip.

    Returns:
        A binary handle (the caller closes it; use it in a ``with`` block).

    Raises:
        FileNotFoundError / IsADirectoryError / NotADirectoryError / PermissionError: as
        :func:`check_input_file`, in one line naming ``path``.
    """
    path = Path(path)
    info = check_input_file(path, what)
    fifo = stat.S_ISFIFO(info.st_mode)
    flags = os.O_RDONLY | getattr(os, "O_BINARY", 0) | (getattr(os, "O_NONBLOCK", 0) if fifo else 0)
    try:
        fd = os.open(path, flags)
    except PermissionError:
        raise PermissionError(f"{path}: permission denied (the {what} cannot be read by this user)") from None
    except FileNotFoundError:  # removed since the check
        raise FileNotFoundError(f"{path}: no such {what}") from None
    if fifo:
        os.set_blocking(fd, True)  # opened without waiting for a writer; now read as any stream
    handle: BinaryIO = open(fd, "rb")  # noqa: SIM115 - returned to the caller, who closes it
    if decompress and path.suffix == ".gz":
        return _GzipInput(handle)  # type: ignore[return-value]  # a GzipFile is a binary stream
    return handle


class _GzipInput(gzip.GzipFile):
    """A gzip stream that closes the file it reads when it is closed (a plain ``GzipFile`` leaves a
    file object it was given open)."""

    def __init__(self, raw: BinaryIO) -> None:
        super().__init__(fileobj=raw, mode="rb")
        self._raw = raw

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._raw.close()


def iter_raw_lines(handle: BinaryIO, name: str, *, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, bytes]]:
    """The lines of a binary stream as bytes, with their numbers (from 1), read a line at a time.

    A line loses its newline (``\\n`` or ``\\r\\n``); a last line without one still counts. Only a
    newline ends a line (``str.splitlines`` would also split at form feeds and Unicode separators,
    which a sentence may hold).

    Args:
        handle: an open binary stream (a file from :func:`open_input`, ``sys.stdin.buffer``).
        name: the stream's name for the messages (a path, or ``<stdin>``).
        max_line_bytes: the longest line read, in bytes without its newline.

    Yields:
        ``(line number, bytes)`` pairs.

    Raises:
        ValueError: a line is longer than ``max_line_bytes`` (naming ``name`` and the line, after
            reading no more than that), or the stream cannot be read (e.g. a truncated ``.gz``).
    """
    number = 0
    while True:
        try:
            raw = handle.readline(max_line_bytes + 2)  # the content, then room for "\r\n"
        except (OSError, EOFError) as err:  # e.g. a truncated or fake .gz, an I/O error
            raise ValueError(f"{name}: cannot read ({' '.join(str(err).split())[:200]})") from None
        if not raw:
            return
        number += 1
        if raw.endswith(b"\n"):
            raw = raw[:-1]
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if len(raw) > max_line_bytes:
            raise ValueError(
                f"{name}, line {number}: longer than {_size(max_line_bytes)} (the limit on one line; "
                "is it a text file with one sentence a line?)"
            )
        yield number, raw


def iter_lines(handle: BinaryIO, name: str, *, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, str]]:
    """The lines of a binary stream decoded as UTF-8, as :func:`iter_raw_lines` reads them.

    Args:
        handle: an open binary stream.
        name: the stream's name for the messages.
        max_line_bytes: the longest line read, in bytes of UTF-8 without its newline.

    Yields:
        ``(line number, text)`` pairs.

    Raises:
        ValueError: a line is too long or not valid UTF-8 (naming ``name`` and the line), or the
            stream cannot be read.
    """
    for number, raw in iter_raw_lines(handle, name, max_line_bytes=max_line_bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{name}, line {number}: not valid UTF-8 ({err.reason} at byte {err.start})") from None
        yield number, text


def read_input_lines(
    path: str | Path | None,
    what: str = "file",
    *,
    stdin: BinaryIO | None = None,
    decompress: bool = False,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> list[str]:
    """Every line of a file, or of standard input when ``path`` is None or ``"-"``, as :func:`iter_lines`
    reads them (blank lines kept).

    Args:
        path: the file (see :func:`open_input`), or None / ``"-"`` for standard input.
        what: what the file is, for the messages.
        stdin: the stream read for standard input (default ``sys.stdin.buffer``).
        decompress: a name ending in ``.gz`` is read through gzip.
        max_line_bytes: the longest line read.

    Returns:
        The lines, without their newlines.

    Raises:
        FileNotFoundError / IsADirectoryError / PermissionError / ValueError: in one line naming the
        file (and the line).
    """
    if path is None or str(path) == "-":
        import sys

        return [text for _, text in iter_lines(stdin or sys.stdin.buffer, STDIN_NAME, max_line_bytes=max_line_bytes)]
    with open_input(path, what, decompress=decompress) as handle:
        return [text for _, text in iter_lines(handle, str(path), max_line_bytes=max_line_bytes)]


def empty_input(path: str | Path) -> str:
    """What to say of an input that held nothing: ``"file is empty"``, or for a FIFO that it had no
    writer (:func:`open_input` does not wait for one).

    Args:
        path: the input read.

    Returns:
        The words that follow ``"{path}: "`` in the message.
    """
    try:
        fifo = stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        fifo = False
    if fifo:
        return "nothing to read (a pipe that no process was writing to, or one closed without writing)"
    return "file is empty"


def _size(n: int) -> str:
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    if n >= 1 << 10 and n % (1 << 10) == 0:
        return f"{n >> 10} KiB"
    return f"{n} bytes"


__all__ = [
    "MAX_LINE_BYTES",
    "STDIN_NAME",
    "check_input_file",
    "empty_input",
    "iter_lines",
    "iter_raw_lines",
    "open_input",
    "read_input_lines",
]
