"""Outputs that are not regular files are written in place, never replaced: a FIFO, a character
device (``/dev/null``, ``/dev/full``), standard output (``/dev/stdout``, ``/dev/fd/N``, ``-o -``), a
socket; a regular file keeps the atomic write (temporary file, fsync, rename). Through
:mod:`qkv.runtime.fileio` and end to end through ``qkv translate -o``, ``qkv evaluate --hyp-out`` and
``qkv attend -o``."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_reliability import one_line_error, train_args, write_pairs

from qkv.cli import main
from qkv.runtime.fileio import WriteFailed, atomic_path, check_output_file, is_special_file, write_bytes, write_text

REPO = Path(__file__).resolve().parent.parent


def is_char_device(path):
    return stat.S_ISCHR(os.stat(path).st_mode)


class FifoReader:
    """A thread reading everything written to a FIFO (opening it waits for the writer)."""

    def __init__(self, path):
        self.data = b""
        self.thread = threading.Thread(target=self._read, args=(path,), daemon=True)
        self.thread.start()

    def _read(self, path):
        with open(path, "rb") as handle:
            self.data = handle.read()

    def result(self):
        self.thread.join(60)  # a guard against a hang only: the writer has finished when this is called
        assert not self.thread.is_alive(), "the FIFO's reader never saw the writer close it"
        return self.data


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny translation run on the date task's files, and a file of sentences to translate."""
    root = tmp_path_factory.mktemp("special")
    src, tgt = write_pairs(root / "data", n=60)
    assert main(train_args(src, tgt, root / "run")) == 0
    sentences = root / "in.txt"
    sentences.write_text("3 March 1998\n12/25/04\nthe first of May, 2010\n", encoding="utf-8")
    return root / "run", sentences, (src, tgt)


@pytest.fixture(scope="module")
def expected(run, tmp_path_factory):
    """The translations of ``in.txt`` as written to a regular file."""
    run_dir, sentences, _ = run
    out = tmp_path_factory.mktemp("expected") / "out.txt"
    assert main(["translate", str(run_dir), str(sentences), "-o", str(out), "--device", "cpu"]) == 0
    text = out.read_text(encoding="utf-8")
    assert len(text.splitlines()) == 3
    return text


# ----------------------------------------------------------------- qkv.runtime.fileio


def test_is_special_file_by_what_the_path_names(tmp_path, fifo):
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to("/dev/null")
    assert is_special_file("/dev/null") and is_special_file(tmp_path / "link") and is_special_file(fifo)
    assert not is_special_file(tmp_path / "file") and not is_special_file(tmp_path / "missing")
    assert not is_special_file(tmp_path)


def test_dev_null_is_written_and_stays_a_device():
    assert check_output_file("/dev/null", "-o/--output") == Path("/dev/null")
    write_text("/dev/null", "gone\n")
    write_bytes("/dev/null", b"gone")
    with atomic_path("/dev/null") as target:  # a writer that opens the path itself (torch.save, savefig)
        assert target == Path("/dev/null")
        target.write_bytes(b"gone")
    assert is_char_device("/dev/null")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_dev_full_fails_in_one_line_naming_it_and_stays_a_device():
    for write in (lambda: write_text("/dev/full", "x\n"), lambda: write_bytes("/dev/full", b"x" * 10000)):
        with pytest.raises(WriteFailed) as caught:
            write()
        message = str(caught.value)
        assert message.startswith("/dev/full: cannot write") and "\n" not in message, message
        assert isinstance(caught.value, ValueError) and caught.value.errno == 28  # ENOSPC
    assert is_char_device("/dev/full")


def test_a_fifo_is_written_in_place(fifo):
    for write, data in (
        (lambda: write_text(fifo, "one\ntwo\n"), b"one\ntwo\n"),
        (lambda: write_bytes(fifo, b"\x00\x01"), b"\x00\x01"),
    ):
        reader = FifoReader(fifo)
        write()
        assert reader.result() == data
        assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(p.name for p in fifo.parent.iterdir()) == ["pipe"]  # no temporary file beside it


def test_dev_fd_of_a_pipe_is_written_in_place():
    read_end, write_end = os.pipe()
    try:
        path = f"/dev/fd/{write_end}"
        assert is_special_file(path) and check_output_file(path) == Path(path)
        write_text(path, "through the pipe\n")
        os.close(write_end)
        write_end = -1
        with os.fdopen(read_end, "rb") as handle:
            read_end = -1
            assert handle.read() == b"through the pipe\n"
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)


def test_a_socket_is_refused_in_one_line_and_kept(tmp_path):
    path = tmp_path / "sock"
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(path))
        with pytest.raises(WriteFailed, match=r"sock: cannot write"):
            write_text(path, "x")
        assert stat.S_ISSOCK(os.stat(path).st_mode)
    finally:
        server.close()


def test_a_directory_is_refused(tmp_path):
    with pytest.raises(IsADirectoryError, match="names a directory"):
        check_output_file(tmp_path, "-o/--output")
    with pytest.raises(IsADirectoryError), atomic_path(tmp_path):
        pass


def test_a_regular_file_is_replaced_atomically(tmp_path):
    """A new file by rename (a new inode), and on an exception the old file as it was, nothing beside it."""
    path = tmp_path / "out.txt"
    path.write_text("old\n")
    inode = os.stat(path).st_ino
    keep = tmp_path / "keep"  # holds the old inode, so the file system cannot reuse its number
    os.link(path, keep)
    write_text(path, "new\n")
    assert path.read_text() == "new\n" and os.stat(path).st_ino != inode and keep.read_text() == "old\n"
    keep.unlink()
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        assert tmp != path and tmp.parent == path.parent
        tmp.write_text("half")
        raise RuntimeError("the writer failed half-way")
    assert path.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_a_symlink_to_a_device_is_written_through(tmp_path):
    link = tmp_path / "out"
    link.symlink_to("/dev/null")
    write_text(link, "x")
    assert link.is_symlink() and os.readlink(link) == "/dev/null" and is_char_device("/dev/null")


# ----------------------------------------------------------------- end to end


def test_translate_to_a_fifo(run, expected, fifo):
    run_dir, sentences, _ = run
    reader = FifoReader(fifo)
    assert main(["translate", str(run_dir), str(sentences), "-o", str(fifo), "--device", "cpu"]) == 0
    assert reader.result().decode("utf-8") == expected
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_translate_to_dev_null_and_dash(run, expected, capsys):
    run_dir, sentences, _ = run
    assert main(["translate", str(run_dir), str(sentences), "-o", "/dev/null", "--device", "cpu"]) == 0
    assert is_char_device("/dev/null")
    capsys.readouterr()
    assert main(["translate", str(run_dir), str(sentences), "-o", "-", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == expected
    assert not Path("-").exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_translate_to_dev_full_is_one_line_exit_2(run, capsys):
    run_dir, sentences, _ = run
    code = main(["translate", str(run_dir), str(sentences), "-o", "/dev/full", "--device", "cpu"])
    line = one_line_error(capsys, "translate", code)
    assert "/dev/full: cannot write (No space left on device)" in line, line
    assert is_char_device("/dev/full")


def test_translate_to_dev_stdout_in_a_child_process(run, expected, tmp_path):
    """``-o /dev/stdout`` with standard output a pipe: the translations arrive on the pipe (the path
    resolves to ``/proc/<pid>/fd/pipe:[...]``, where no temporary file can be made)."""
    run_dir, sentences, _ = run
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(
        [sys.executable, "-m", "qkv", "translate", str(run_dir), str(sentences), "-o", "/dev/stdout"],
        capture_output=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode("utf-8") == expected
    assert list(tmp_path.iterdir()) == []


def test_evaluate_hyp_out_to_a_fifo_and_dev_null(run, expected, fifo, capsys):
    run_dir, sentences, (src, tgt) = run
    args = ["evaluate", str(run_dir), "--src", str(src), "--ref", str(tgt), "--limit", "5", "--device", "cpu"]
    regular = fifo.parent / "hyps.txt"
    assert main([*args, "--hyp-out", str(regular)]) == 0
    reader = FifoReader(fifo)
    assert main([*args, "--hyp-out", str(fifo)]) == 0
    assert reader.result().decode("utf-8") == regular.read_text(encoding="utf-8")
    assert len(regular.read_text(encoding="utf-8").splitlines()) == 5
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert main([*args, "--hyp-out", "/dev/null"]) == 0
    assert is_char_device("/dev/null")
    capsys.readouterr()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_evaluate_and_attend_to_dev_full_are_one_line_exit_2(run, capsys):
    run_dir, _, (src, tgt) = run
    args = ["evaluate", str(run_dir), "--src", str(src), "--ref", str(tgt), "--limit", "2", "--device", "cpu"]
    assert "/dev/full: cannot write" in one_line_error(capsys, "evaluate", main([*args, "--hyp-out", "/dev/full"]))
    code = main(["attend", "3 March 1998", "--model", str(run_dir), "-o", "/dev/full"])
    assert "/dev/full: cannot write" in one_line_error(capsys, "attend", code)
    assert is_char_device("/dev/full")


def test_attend_to_a_fifo(run, fifo, tmp_path, capsys):
    run_dir, _, _ = run
    reader = FifoReader(fifo)
    assert main(["attend", "3 March 1998", "--model", str(run_dir), "-o", str(fifo)]) == 0
    page = reader.result().decode("utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    code = main(["attend", "3 March 1998", "--model", str(run_dir), "-o", str(tmp_path)])
    assert "names a directory" in one_line_error(capsys, "attend", code)
