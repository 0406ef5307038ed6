"""Input text is read a line at a time with a bound on a line's length (qkv.runtime.textinput), from
any stream: ``/dev/zero`` or a file with no newline is refused after 1 MiB, in one line naming the
file and line, through every command that reads sentences; a FIFO, a pipe's ``/dev/fd/N`` (a
shell's ``<(...)``) and ``/dev/stdin`` are read; a directory, a missing file and an unreadable one
are each said as what they are."""

from __future__ import annotations

import gzip
import io
import json
import os
import threading
import tracemalloc

import pytest
from test_reliability import one_line_error, train_args, write_pairs

from qkv.cli import main
from qkv.data.parallel import read_lines, read_parallel
from qkv.data.text import read_text
from qkv.runtime import textinput
from qkv.runtime.safe_load import weights_header
from qkv.runtime.textinput import (
    MAX_LINE_BYTES,
    check_input_file,
    iter_lines,
    open_input,
    read_input_lines,
)
from qkv.viz.corpus import read_corpus

ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False


class CountingReader(io.RawIOBase):
    """An endless stream of zero bytes (``/dev/zero``) that counts what was read from it."""

    def __init__(self):
        self.given = 0

    def readable(self):
        return True

    def readinto(self, buffer):
        n = len(buffer)
        buffer[:n] = bytes(n)
        self.given += n
        return n


def zero_stdin(monkeypatch):
    """Standard input as ``/dev/zero``, counting the bytes qkv took from it."""
    raw = CountingReader()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BufferedReader(raw)))
    return raw


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny translation run on the date task's files: (its folder, its training files)."""
    root = tmp_path_factory.mktemp("lines")
    src, tgt = write_pairs(root / "data", n=60)
    assert main(train_args(src, tgt, root / "run")) == 0
    return root / "run", (src, tgt)


@pytest.fixture
def long_line(tmp_path):
    """A file whose second line is one byte over the bound."""
    path = tmp_path / "long.txt"
    path.write_bytes(b"a short line\n" + b"x" * (MAX_LINE_BYTES + 1) + b"\nafter\n")
    return path


# ----------------------------------------------------------------- the reader


def test_lines_split_at_newlines_only():
    data = "one\r\ntwo\u2028still two\x0cand two\n\nlast without newline".encode()
    got = list(iter_lines(io.BytesIO(data), "x"))
    assert got == [(1, "one"), (2, "two\u2028still two\x0cand two"), (3, ""), (4, "last without newline")]


def test_a_line_at_the_bound_is_read_and_one_byte_more_is_refused():
    limit = 10
    assert list(iter_lines(io.BytesIO(b"0123456789\r\n0123456789"), "x", max_line_bytes=limit)) == [
        (1, "0123456789"),
        (2, "0123456789"),
    ]
    with pytest.raises(ValueError, match=r"^x, line 2: longer than 10 bytes"):
        list(iter_lines(io.BytesIO(b"ok\n01234567890\n"), "x", max_line_bytes=limit))


def test_an_endless_line_is_refused_after_the_bound():
    raw = CountingReader()
    with pytest.raises(ValueError, match=r"^<stdin>, line 1: longer than 1 MiB"):
        read_input_lines(None, stdin=io.BufferedReader(raw))
    assert raw.given < 2 * MAX_LINE_BYTES  # what was read: the bound and one buffer, not the stream


def test_bad_utf8_names_the_line():
    with pytest.raises(ValueError, match=r"^f, line 2: not valid UTF-8"):
        list(iter_lines(io.BytesIO(b"ok\ncaf\xe9\n"), "f"))


def test_a_normal_file_reads_as_before(tmp_path):
    lines = ["A man rides a bike.", "Ein Mann fährt Fahrrad.", "  spaces kept  ", "tab\tinside"]
    path = tmp_path / "normal.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert read_lines(path) == lines
    assert read_input_lines(path) == lines
    gz = tmp_path / "normal.txt.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert read_lines(gz) == lines
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(b"first\r\nsecond")  # Windows newlines, no final newline
    assert read_lines(crlf) == ["first", "second"]
    assert read_corpus(path) == [(1, lines[0]), (2, lines[1]), (3, "spaces kept"), (4, "tab\tinside")]


def test_a_large_sparse_file_is_not_read_whole(tmp_path):
    path = tmp_path / "sparse.txt"
    with open(path, "wb") as handle:
        handle.truncate(256 * MAX_LINE_BYTES)  # 256 MiB of zero bytes, no newline, no disk used
    tracemalloc.start()
    try:
        for read in (read_lines, read_input_lines, read_corpus):
            with pytest.raises(ValueError, match="line 1: longer than 1 MiB"):
                read(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 * MAX_LINE_BYTES, peak


def test_read_parallel_names_the_long_line(tmp_path, long_line):
    ok = tmp_path / "ok.txt"
    ok.write_text("a\nb\nc\n")
    with pytest.raises(ValueError, match=r"long.txt, line 2: longer than 1 MiB"):
        read_parallel(ok, long_line)


# ----------------------------------------------------------------- the commands


def test_translate_stdin_from_dev_zero(run, monkeypatch, capsys):
    raw = zero_stdin(monkeypatch)
    code = main(["translate", str(run[0]), "--device", "cpu"])
    assert "<stdin>, line 1: longer than 1 MiB" in one_line_error(capsys, "translate", code)
    assert raw.given < 2 * MAX_LINE_BYTES


def test_translate_and_evaluate_refuse_dev_zero_and_a_long_line(run, long_line, capsys):
    run_dir, (src, tgt) = run
    for path, line in (("/dev/zero", 1), (str(long_line), 2)):
        code = main(["translate", str(run_dir), path, "--device", "cpu"])
        assert f"{path}, line {line}: longer than 1 MiB" in one_line_error(capsys, "translate", code)
    code = main(["evaluate", str(run_dir), "--src", str(src), "--ref", "/dev/zero", "--device", "cpu"])
    assert "/dev/zero, line 1: longer than 1 MiB" in one_line_error(capsys, "evaluate", code)
    code = main(["evaluate", str(run_dir), "--src", str(long_line), "--ref", str(tgt), "--device", "cpu"])
    assert "long.txt, line 2: longer than 1 MiB" in one_line_error(capsys, "evaluate", code)


def test_translate_stdin_and_file_agree(run, tmp_path, monkeypatch, capsys):
    run_dir, _ = run
    path = tmp_path / "in.txt"
    path.write_text("3 March 1998\n12/25/04\n", encoding="utf-8")
    assert main(["translate", str(run_dir), str(path), "--device", "cpu"]) == 0
    from_file = capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(path.read_bytes())))
    assert main(["translate", str(run_dir), "--device", "cpu"]) == 0
    assert capsys.readouterr().out == from_file and len(from_file.splitlines()) == 2


def test_train_refuses_a_long_line(tmp_path, long_line, capsys):
    src, _ = write_pairs(tmp_path / "data", n=3)
    code = main(train_args(src, "/dev/zero", tmp_path / "run"))
    assert "/dev/zero, line 1: longer than 1 MiB" in one_line_error(capsys, "train", code)
    code = main(train_args(long_line, src, tmp_path / "run"))
    assert "long.txt, line 2: longer than 1 MiB" in one_line_error(capsys, "train", code)
    assert not (tmp_path / "run").exists()


def test_embed_refuses_dev_zero_before_loading_a_model(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "no-model"  # never reached: the input is refused first
    code = main(["embed", "-i", "/dev/zero", "--model", str(missing)])
    assert "/dev/zero, line 1: longer than 1 MiB" in one_line_error(capsys, "embed", code)
    raw = zero_stdin(monkeypatch)
    code = main(["embed", "--model", str(missing)])
    assert "<stdin>, line 1: longer than 1 MiB" in one_line_error(capsys, "embed", code)
    assert raw.given < 2 * MAX_LINE_BYTES


def test_attend_corpus_refuses_dev_zero(tmp_path, capsys):
    code = main(
        ["attend", "--corpus", "/dev/zero", "--model", str(tmp_path / "no-model"), "-o", str(tmp_path / "a.html")]
    )
    assert "/dev/zero, line 1: longer than 1 MiB" in one_line_error(capsys, "attend", code)
    assert not (tmp_path / "a.html").exists()


# ----------------------------------------------------------------- what may be read


def writer_thread(path, data):
    def write():
        with open(path, "wb") as handle:
            handle.write(data)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def in_thread(function, *args):
    """``function(*args)`` in a thread, joined with a guard against a hang: (result, error)."""
    box = {}

    def call():
        try:
            box["result"] = function(*args)
        except Exception as err:  # noqa: BLE001 - handed to the test
            box["error"] = err

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), f"{function.__name__} blocked"
    return box.get("result"), box.get("error")


def test_a_fifo_with_a_writer_is_read(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for read, expected in (
        (read_lines, ["a dog runs", "the cat"]),
        (read_corpus, [(1, "a dog runs"), (2, "the cat")]),
        (read_text, "a dog runs\nthe cat\n"),
    ):
        thread = writer_thread(fifo, b"a dog runs\nthe cat\n")
        result, error = in_thread(read, fifo)
        thread.join(60)
        assert error is None and result == expected


def test_a_fifo_without_a_writer_is_refused_at_once(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    _, error = in_thread(read_corpus, fifo)
    assert isinstance(error, ValueError) and "no sentences" in str(error)
    _, error = in_thread(read_lines, fifo)
    assert isinstance(error, ValueError) and "nothing to read" in str(error)


def test_a_pipe_as_dev_fd_is_read_like_a_process_substitution(run, capsys):
    """``qkv translate RUN <(printf ...)``: bash passes ``/dev/fd/63``, the read end of a pipe."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"3 March 1998\n12/25/04\n")
        os.close(write_end)
        write_end = -1
        assert read_lines(f"/dev/fd/{read_end}") == ["3 March 1998", "12/25/04"]
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"3 March 1998\n")
        os.close(write_end)
        write_end = -1
        assert main(["translate", str(run[0]), f"/dev/fd/{read_end}", "--device", "cpu"]) == 0
        assert len(capsys.readouterr().out.splitlines()) == 1
    finally:
        os.close(read_end)


def test_dev_stdin_is_read(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("from stdin\n")
    with open(path, "rb") as handle:
        saved = os.dup(0)
        os.dup2(handle.fileno(), 0)
        try:
            assert read_lines("/dev/stdin") == ["from stdin"]
        finally:
            os.dup2(saved, 0)
            os.close(saved)


def test_missing_directory_and_file_under_a_file_are_each_named(tmp_path, run, capsys):
    (tmp_path / "file.txt").write_text("x\n")
    for path, words in (
        (tmp_path / "missing.txt", "missing.txt: no such"),
        (tmp_path, "is a directory"),
        (tmp_path / "file.txt" / "inside", "a part of the path is a file"),
    ):
        with pytest.raises(OSError, match=words):
            read_lines(path)
        code = main(["translate", str(run[0]), str(path), "--device", "cpu"])
        assert words in one_line_error(capsys, "translate", code)
        code = main(["embed", "-i", str(path), "--model", str(tmp_path / "no-model")])
        assert words in one_line_error(capsys, "embed", code)
    with pytest.raises(IsADirectoryError, match="is a directory"):
        read_text(tmp_path)
    with pytest.raises(IsADirectoryError, match="is a directory"):
        weights_header(tmp_path)
    with pytest.raises(FileNotFoundError, match="weights file not found"):
        weights_header(tmp_path / "model.safetensors")


def test_permission_denied_is_said_as_such(tmp_path, monkeypatch):
    """As root any file can be read, so the refusal of the access check is stood in for."""
    path = tmp_path / "secret.txt"
    path.write_text("x\n")
    monkeypatch.setattr(textinput.os, "access", lambda *args, **kwargs: False)
    for call in (check_input_file, open_input, read_lines, read_text, weights_header):
        with pytest.raises(PermissionError, match=r"secret.txt: permission denied"):
            call(path)


@pytest.mark.skipif(ROOT, reason="root reads any file")
def test_permission_denied_for_real(tmp_path, run, capsys):
    path = tmp_path / "secret.txt"
    path.write_text("x\n")
    path.chmod(0)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes((run[0] / "model.safetensors").read_bytes())
    weights.chmod(0)
    with pytest.raises(PermissionError, match="permission denied"):
        read_lines(path)
    with pytest.raises(PermissionError, match="permission denied"):
        weights_header(weights)
    code = main(["translate", str(run[0]), str(path), "--device", "cpu"])
    assert "secret.txt: permission denied" in one_line_error(capsys, "translate", code)


def test_train_reads_its_pairs_from_pipes(tmp_path, capsys):
    """``qkv train --train-src <(zcat a.gz) --train-tgt <(zcat b.gz)``: the pipes' names are kept (their
    resolved ``/proc/.../pipe:[N]`` targets cannot be opened) and a run trains on what they carried."""
    src, tgt = write_pairs(tmp_path / "data", n=40)
    ends = []
    try:
        for path in (src, tgt):
            read_end, write_end = os.pipe()
            ends.append(read_end)
            os.write(write_end, path.read_bytes())  # 40 short lines fit a pipe's buffer
            os.close(write_end)
        argv = train_args(f"/dev/fd/{ends[0]}", f"/dev/fd/{ends[1]}", tmp_path / "run")
        assert main(argv) == 0, capsys.readouterr().err
    finally:
        for end in ends:
            os.close(end)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data"]["train_src"] == f"/dev/fd/{ends[0]}"
    assert (tmp_path / "run" / "model.safetensors").is_file()
