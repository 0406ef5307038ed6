"""Fuzzed formats, measured: every file format qkv reads, made by qkv itself (or by Hugging Face
``transformers``), mutated by hypothesis and read back through the public path.

Formats, and what reads them here:

* a translation run and a language-model run (``qkv train``, 2 steps): ``config.json``,
  ``tokenizer.json`` (BPE; the language model's: characters), ``model.safetensors``
  (:func:`qkv.runs.folder.load_run`), ``state.pt`` (:func:`qkv.training.checkpoint_files.load_checkpoint`); the
  run's ``config.json`` also through ``qkv translate`` / ``qkv generate`` (:func:`qkv.cli.main`);
* a prepared folder (``qkv prepare``): its arrays (``.bin``/``.idx``/``.len``/``.lines``) and
  ``tokenizer.json``, ``manifest.json``, the hash cache ``verified.json``
  (:class:`qkv.data.prepared.PreparedCorpus`, ``verify``, then reading every pair);
* a GPT-2 and a BERT folder (``save_pretrained``, safetensors): ``config.json``,
  ``model.safetensors``, ``tokenizer.json``, BERT's ``tokenizer_config.json``
  (:func:`qkv.load_pretrained`); BERT's ``config.json`` also through ``qkv embed``.

Mutations: byte flips, bytes set, 8-byte integers written (an offset of 2**40, -1, ...),
truncation, garbage inserted, spans deleted, at random offsets (binary files, and JSON files as
text); and structured JSON mutations: a value of another type (null, bool, string, list, object,
NaN, 10**9, 10**12, 2**64, ...), another value of the same type (negative, zero, huge, longer
strings), a key deleted, a key added, a value nested in a list or an object, the same document
re-indented or with its keys reordered.

One mutation is OK when the reader either
  * refuses it with ``ValueError`` / ``FileNotFoundError`` whose message is ONE line naming the
    file (the folder's path or the file's name appears in it); through the CLI: exit 2 and one
    line ``qkv <command>: error: ...``; or
  * succeeds with a correct result: the same outputs as the unmutated files (to the bit) for a
    mutation that keeps the meaning (whitespace, key order) or that gives a value of the wrong
    type; for a same-type edit of a value, finite outputs (the file says something else and the
    model does it); for a Hugging Face config, every field qkv reads equal to the value
    ``transformers`` reads from the same file.
Anything else is NOT OK: another exception type (a traceback; through the CLI, exit 1), a
multi-line message or one that names no file, more than ``EXAMPLE_LIMIT_S`` seconds for one
mutation (a hang guard, not a timing assertion), an allocation beyond the memory headroom
(``RLIMIT_AS`` is lowered around each mutation, so a blow-up is an allocator error here, not a
machine out of memory), or a wrong result.

Examples are derandomized (the same on every run); ``QKV_FUZZ_EXAMPLES=N`` runs N mutations per
format, ``QKV_FUZZ_RANDOM=1`` explores new ones, ``QKV_FUZZ_REPORT=path`` appends one JSON line per
format with the mutations tried and their outcomes (each test also prints that line: ``-s``).

Defects this fuzz found (each now fixed, its test kept with the minimal reproducer as an explicit
example): state.pt's CRC-32s were not checked (a changed byte loaded as another state; a directory
bit in the zip's central directory loaded a tensor as uninitialized memory); config.json's
``decode`` section was used unchecked by qkv translate; model fields of the wrong type loaded
(layer_norm_eps true, scale_embedding 1) and a deleted model field took its default; a language
model's ``chars`` were not compared with the model; a manifest's ``sources`` were not checked;
GPT-2's huge sizes were built before they were checked (n_layer 10**9: minutes and all memory);
BERT's config values were not checked; tokenizer files that made the tokenizers library panic (a
BaseException) or fail at the first encode; BERT's tokenizer_config.json was not checked; and,
found by a random run of 800 mutations a format after those fixes, a BERT post-processor special
token id past the vocabulary, and tokenizer_config.json's model_max_length Infinity. A new defect
gets a strict xfail test named ``test_known_bug_*`` and its region left out of the main tests
until it is fixed.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import math
import os
import shutil
import signal
import struct
import zipfile
from collections import Counter
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, example, given, note, settings
from hypothesis import strategies as st
from test_reliability import train_args, write_pairs

import qkv
from qkv.cli import main
from qkv.data.prepared import PreparedCorpus, folder_fingerprint, split_files
from qkv.decoding.search import greedy_decode
from qkv.runs.folder import load_run
from qkv.training.checkpoint_files import load_checkpoint

try:
    import resource
except ImportError:  # not on Windows: the memory guard is then off
    resource = None

EXAMPLES = int(os.environ.get("QKV_FUZZ_EXAMPLES", "0"))
EXAMPLE_LIMIT_S = 60  # one mutation's load: far above any real one (a hang guard, not a timing test)
MEMORY_HEADROOM = 3 * 2**30  # address space a mutation may add to the process's (it needs a few MiB)
REPORT = os.environ.get("QKV_FUZZ_REPORT")


def fuzz(default: int):
    """Hypothesis settings for one format: ``default`` mutations (``QKV_FUZZ_EXAMPLES`` overrides)."""
    return settings(
        max_examples=EXAMPLES or default,
        deadline=None,
        derandomize=not os.environ.get("QKV_FUZZ_RANDOM"),
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


# ------------------------------------------------------------------ counting
class Tally:
    """Mutations tried on one format and their outcomes; :meth:`report` prints and records them."""

    def __init__(self, name: str) -> None:
        self.name, self.outcomes = name, Counter()

    def __call__(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        event(outcome)

    @property
    def tried(self) -> int:
        return sum(self.outcomes.values())

    def report(self, record_property=None) -> None:
        line = {"format": self.name, "mutations": self.tried, "outcomes": dict(sorted(self.outcomes.items()))}
        print(f"fuzz: {json.dumps(line)}")
        if record_property is not None:
            record_property("fuzz_mutations", self.tried)
        if REPORT:
            with open(REPORT, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(line) + "\n")
        assert self.tried > 0


# ------------------------------------------------------------------ guards: hangs and memory
class _Hang(BaseException):
    """Raised by the alarm: a BaseException, so no loader's ``except Exception`` can swallow it."""


def _address_space() -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def guarded(what: str):
    """Run a block under an alarm of ``EXAMPLE_LIMIT_S`` and an address-space limit of the
    process's current size plus ``MEMORY_HEADROOM`` (Linux; elsewhere unguarded)."""
    if resource is None or not hasattr(signal, "SIGALRM") or not Path("/proc/self/status").is_file():
        yield
        return

    def on_alarm(signum, frame):
        raise _Hang

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _address_space() + MEMORY_HEADROOM
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    previous = signal.signal(signal.SIGALRM, on_alarm)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    signal.alarm(EXAMPLE_LIMIT_S)
    try:
        yield
    except _Hang:
        raise AssertionError(f"{what}: no answer within {EXAMPLE_LIMIT_S} s (a hang)") from None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# ------------------------------------------------------------------ the rule for one mutation
def names_a_file(message: str, folder: Path) -> bool:
    """The message names the folder or one of its files (by path or by name)."""
    return str(folder) in message or any(p.name in message for p in folder.iterdir() if p.is_file())


@contextlib.contextmanager
def not_even_an_exception(what: str):
    """A BaseException that is not an Exception (the ``tokenizers`` library's Rust panics,
    ``pyo3_runtime.PanicException``) passes every ``except Exception``, qkv.cli.main's last line
    of defence included; hypothesis would not report the mutation behind it either. Made an
    AssertionError (NOT OK) here, so it is reported and shrunk like any other."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit, _Hang):
        raise
    except Exception:
        raise
    except BaseException as err:
        name = f"{type(err).__module__}.{type(err).__name__}"
        raise AssertionError(f"{what}: {name}, a BaseException that no `except Exception` catches: {err}") from err


def attempt(call, folder: Path, what: str):
    """``("loaded", call())``, or ``("refused", message)`` for a ValueError / FileNotFoundError of
    one line naming a file of ``folder``; any other exception propagates (NOT OK: a traceback)."""
    with guarded(what), not_even_an_exception(what):
        try:
            return "loaded", call()
        except (ValueError, FileNotFoundError) as err:
            message = str(err)
            note(f"refused: {type(err).__name__}: {message}")
            assert message.strip() and "\n" not in message, f"{what}: a message of more than one line: {message!r}"
            assert names_a_file(message, folder), f"{what}: the message names no file: {message!r}"
            return "refused", message


def run_cli(argv: list[str], what: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``qkv.cli.main(argv)``, guarded."""
    out, err = io.StringIO(), io.StringIO()
    with guarded(what), not_even_an_exception(what), redirect_stdout(out), redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exit_:  # argparse
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def judge_cli(
    code: int,
    out: str,
    err: str,
    folder: Path,
    command: str,
    reference: str,
    strict: bool,
    tally: Tally,
    kind: str | None = None,
):
    """The CLI's rule: exit 0 with the reference output (or, for an edit, any output), or exit 2
    with one line ``qkv <command>: error: ...`` naming a file; never exit 1 (a fault) or a traceback;
    exit 0 for a ``kind`` "neutral" mutation (re-formatted JSON)."""
    note(f"exit {code}; stderr: {err!r}")
    assert "Traceback" not in err, err
    assert code == 0 or kind != "neutral", f"qkv {command} refused a re-formatted file: {err}"
    if code == 0:
        if out == reference:
            tally("loaded, same result")
        else:
            assert not strict, (
                f"qkv {command} succeeded with another output after a mutation that keeps the "
                f"meaning or gives a value of the wrong type:\n{out!r}\nexpected\n{reference!r}"
            )
            tally("loaded, edited value obeyed")
        return
    lines = [line for line in err.splitlines() if line.startswith(f"qkv {command}: error:")]
    assert code == 2, f"qkv {command} exited {code} (a fault, not an input error): {err}"
    assert len(lines) == 1, err
    assert names_a_file(lines[0], folder), f"the message names no file: {lines[0]!r}"
    tally("refused")


def same(a, b) -> bool:
    """Equal to the bit: tensors (dtype, shape, values), strings, numbers, containers."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def finite(result) -> bool:
    if isinstance(result, torch.Tensor):
        return not result.is_floating_point() or bool(torch.isfinite(result).all())
    if isinstance(result, dict):
        return all(finite(v) for v in result.values())
    if isinstance(result, (list, tuple)):
        return all(finite(v) for v in result)
    return True


def judge_weights(result, reference, only_data: bool, tally: Tally) -> None:
    """A load of a changed safetensors file that succeeded. safetensors has no checksum, so a
    change inside the tensor DATA bytes loads as another weight (NaN included: the bytes of -1 are
    a NaN float); that, and nothing else, may give another result."""
    if same(result, reference):
        tally("loaded, same result")
        return
    assert only_data, "loaded with a different result after a change to the header or the size (a silent wrong result)"
    tally("loaded, tensor data changed (safetensors has no checksum)")


def judge_refused(kind: str, tally: Tally) -> None:
    """A refusal (already checked: one line naming the file) is right unless the file still says
    what it said: a re-formatted JSON file, or bytes that came out unchanged, must load."""
    assert kind != "neutral", "refused a file that keeps its meaning (re-formatted JSON or unchanged bytes)"
    tally("refused")


def judge_loaded(result, reference, kind: str, strict_kinds: set[str], tally: Tally) -> None:
    """A load that succeeded: the reference result for a mutation of a ``strict_kinds`` kind
    (meaning kept, or a value of the wrong type that must not be read as something else), else
    (an edit of a value) any finite result."""
    if same(result, reference):
        tally("loaded, same result")
        return
    assert kind not in strict_kinds, f"loaded with a different result after a {kind!r} mutation (a silent wrong result)"
    assert finite(result), f"loaded after a {kind!r} mutation, and the outputs are not finite (a silent wrong result)"
    tally("loaded, edited value obeyed")


# ------------------------------------------------------------------ byte mutations
NOTABLE_INT64 = [-1, 0, 1, 2**31, 2**32, 2**40, 2**62, 2**63 - 1, -(2**63), 10**12]


@st.composite
def byte_mutations(
    draw,
    size: int,
    regions: list[tuple[int, int]] | None = None,
    *,
    resizing: bool = True,
    resize_regions: list[tuple[int, int]] | None = None,
):
    """A list of 1-3 byte operations on a file of ``size`` bytes. Offsets fall in ``regions``
    (``[start, end)`` pairs; default: the whole file, often its first 256 bytes, where headers
    are). ``resizing``: also truncation, insertion and deletion, at offsets in ``resize_regions``
    (default: ``regions``)."""
    regions = [(a, b) for a, b in regions or [(0, min(size, 256)), (0, size)] if b > a]
    resize_regions = [(a, b) for a, b in resize_regions or regions if b > a]

    def offset(resizing_op: bool = False):
        a, b = draw(st.sampled_from(resize_regions if resizing_op else regions))
        return draw(st.integers(a, b - 1))

    ops = []
    for _ in range(draw(st.integers(1, 3))):
        kinds = ["flip", "set", "int64", "garbage"] + (["truncate", "insert", "delete"] if resizing else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "flip":
            ops.append(("flip", offset(), draw(st.integers(1, 255))))
        elif kind == "set":
            ops.append(("set", offset(), draw(st.sampled_from([0, 0xFF, 0x7F, 0x80, ord("{"), ord('"'), ord("9")]))))
        elif kind == "int64":
            ops.append(("int64", offset(), draw(st.sampled_from(NOTABLE_INT64))))
        elif kind == "garbage":
            ops.append(("garbage", offset(), draw(st.binary(min_size=1, max_size=16))))
        elif kind == "truncate":
            ops.append(("truncate", offset(True)))
        elif kind == "insert":
            ops.append(("insert", offset(True), draw(st.binary(min_size=1, max_size=16))))
        else:
            ops.append(("delete", offset(True), draw(st.integers(1, 64))))
    return ops


def apply_bytes(data: bytes, ops) -> tuple[bytes, list[tuple[int, int]] | None]:
    """The mutated bytes, and the ``[i, i + 1)`` ranges of the bytes that differ from ``data``
    (None when the size changed)."""
    out = bytearray(data)
    for op in ops:
        kind, at = op[0], min(op[1], max(len(out) - 1, 0))
        if kind == "flip" and out:
            out[at] ^= op[2]
        elif kind == "set" and out:
            out[at] = op[2]
        elif kind in ("int64", "garbage") and out:
            piece = struct.pack("<q", op[2]) if kind == "int64" else op[2]
            piece = piece[: len(out) - at]
            out[at : at + len(piece)] = piece
        elif kind == "truncate":
            del out[at:]
        elif kind == "insert":
            out[at:at] = op[2]
        elif kind == "delete":
            del out[at : at + op[2]]
    if len(out) != len(data):
        return bytes(out), None
    differ = np.nonzero(np.frombuffer(bytes(out), np.uint8) != np.frombuffer(data, np.uint8))[0]
    return bytes(out), [(int(i), int(i) + 1) for i in differ]


# ------------------------------------------------------------------ JSON mutations
KIND_OF = {type(None): "null", bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "object"}
POOL = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2,
    10**9,
    10**12,
    -(10**12),
    2**63,
    2**64,
    0.0,
    0.5,
    -1.5,
    1e308,
    float("nan"),
    float("inf"),
    "",
    "x",
    "0",
    "true",
    "false",
    "gelu",
    "../../x",
    "\x00",
    "ünï",
    [],
    [1],
    [None],
    {},
    {"a": 1},
]


def kind_of(value) -> str:
    return KIND_OF[type(value)]


def equal_number(a, b) -> bool:
    numeric = (int, float)
    return (
        isinstance(a, numeric)
        and isinstance(b, numeric)
        and not isinstance(a, bool)
        and not isinstance(b, bool)
        and a == b
    )


def same_kind_values(value) -> list:
    """Other values of ``value``'s own kind: zero, negative, huge, near, longer, emptier."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value - 1, 0, -value, -1, 10**9, 10**12, 2**63, 2 * value + 1]
    if isinstance(value, float):
        return [0.0, -value, value * 1e9 + 1.0, 1e-300, value + 1.0, 1e308, float("nan"), float("inf")]
    if isinstance(value, str):
        return ["", value + "x", value[:-1], value.upper() + "Z", value * 3 + "!", "gelu", "relu", "uint32", "F16"]
    return []


def get(doc, path):
    for key in path:
        doc = doc[key]
    return doc


def differing_paths(a, b, path: tuple = ()):
    """The paths at which two JSON values differ (the outermost of each difference)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in {*a, *b}:
            if key not in a or key not in b:
                yield (*path, key)
            else:
                yield from differing_paths(a[key], b[key], (*path, key))
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from differing_paths(x, y, (*path, i))
    elif not (type(a) is type(b) and a == b):
        yield path


class Mutation(NamedTuple):
    text: str  # the mutated file's text
    kind: str  # neutral, retype, revalue, delete, add, raw
    what: str  # what was done, for the report
    path: tuple | None  # where (None: the whole text)


DELETE = object()  # edited(): delete the key


def json_mutations(doc, *, start: list[tuple] | None = None, exclude: tuple = (), skip=None):
    """A :class:`Mutation` of the JSON document ``doc``: one structured mutation at a path drawn
    from one of the ``start`` paths downwards (default: the whole document; paths beginning with
    one of ``exclude`` are left out, raw edits of them too; so are mutations for which
    ``skip(mutation)`` is true), or the document re-formatted (kind "neutral"), or its text
    corrupted at the byte level ("raw", or "neutral" when it still parses to the same value)."""
    return _json_mutations(doc, start, tuple(tuple(e) for e in exclude)).filter(
        lambda m: m.kind != "excluded" and not (skip and skip(m))
    )


@st.composite
def _json_mutations(draw, doc, start, exclude):
    original = json.dumps(doc, indent=2, ensure_ascii=False)
    choice = draw(st.sampled_from(["structured"] * 6 + ["neutral", "raw"])) if start is None else "structured"
    if choice == "neutral":
        style = draw(st.sampled_from(["compact", "indent4", "sorted", "reversed", "ascii"]))
        if style == "reversed":

            def reverse(node):
                if isinstance(node, dict):
                    return {k: reverse(node[k]) for k in reversed(list(node))}
                if isinstance(node, list):
                    return [reverse(x) for x in node]
                return node

            text = json.dumps(reverse(doc), indent=2, ensure_ascii=False)
        else:
            text = json.dumps(
                doc,
                indent={"compact": None, "indent4": 4}.get(style, 2),
                sort_keys=style == "sorted",
                ensure_ascii=style == "ascii",
                separators=(",", ":") if style == "compact" else None,
            )
        return Mutation(text, "neutral", f"re-formatted ({style})", None)
    if choice == "raw":
        data = original.encode("utf-8")
        mutated, _ = apply_bytes(data, draw(byte_mutations(len(data))))
        try:
            paths = list(differing_paths(doc, json.loads(mutated.decode("utf-8"))))
        except ValueError:
            paths = [()]
        kind = (
            "neutral"
            if not paths
            else "excluded"
            if all(any(p[: len(e)] == e for e in exclude) for p in paths)
            else "raw"
        )
        return Mutation(mutated.decode("utf-8", errors="surrogateescape"), kind, "bytes of the text", None)

    doc = copy.deepcopy(doc)
    path = tuple(draw(st.sampled_from(start))) if start is not None else ()
    node = get(doc, path)
    while isinstance(node, (dict, list)) and node and draw(st.integers(0, 3)) > 0:
        keys = [
            k
            for k in (list(node) if isinstance(node, dict) else range(len(node)))
            if not any((*path, k)[: len(e)] == tuple(e) for e in exclude)
        ]
        if not keys:
            break
        key = keys[draw(st.integers(0, len(keys) - 1))]
        path, node = (*path, key), node[key]
    parent = get(doc, path[:-1]) if path else None
    ops = (
        ["retype", "nest"]
        + (["revalue"] if same_kind_values(node) or isinstance(node, list) and node else [])
        + (["delete"] if path else [])
        + (["add"] if isinstance(node, (dict, list)) else [])
    )
    op = draw(st.sampled_from(ops))

    def put(value):
        nonlocal doc
        if path:
            parent[path[-1]] = value
        else:
            doc = value

    if op == "retype":
        value = draw(st.sampled_from(POOL).filter(lambda v: kind_of(v) != kind_of(node) and not equal_number(v, node)))
        put(value)
        # null in an optional field is another value of it, not another type
        kind = "revalue" if node is None else "delete" if value is None else "retype"
        what = f"{list(path)}: {node!r:.60} -> {value!r:.60}"
    elif op == "revalue":
        if isinstance(node, list):
            value = list(reversed(node)) if draw(st.booleans()) else node[:-1]
        else:
            value = draw(st.sampled_from(same_kind_values(node)))
        put(value)
        kind, what = "revalue", f"{list(path)}: {node!r:.60} -> {value!r:.60}"
    elif op == "nest":
        value = [node] if draw(st.booleans()) else {"value": node}
        put(value)
        kind, what = "retype", f"{list(path)}: nested in {type(value).__name__}"
    elif op == "delete":
        del parent[path[-1]]
        kind, what = "delete", f"{list(path)} deleted"
    else:
        value = draw(st.sampled_from(POOL))
        if isinstance(node, dict):
            name = draw(
                st.one_of(
                    st.sampled_from(["zz_fuzz", "", "model", "step", "vocab_size", "__metadata__"]), st.text(max_size=6)
                )
            )
            if name not in node:
                kind = "add"
            else:  # an existing key: another value of it
                kind = "revalue" if kind_of(value) == kind_of(node[name]) else "retype"
            node[name] = value
            what = f"{list(path)}: key {name!r} = {value!r:.40}"
            path = (*path, name)
            if any(path[: len(e)] == e for e in exclude):
                kind = "excluded"
        else:
            at = draw(st.integers(0, len(node)))
            node.insert(at, value if draw(st.booleans()) or not node else node[min(at, len(node) - 1)])
            kind, what = "add", f"{list(path)}: item inserted at {at}"
    return Mutation(json.dumps(doc, indent=2, ensure_ascii=False), kind, what, path)


def edited(doc, path: tuple, value, kind: str = "retype") -> Mutation:
    """One mutation as :func:`json_mutations` gives it: ``doc`` with the value at ``path`` replaced
    (an explicit example: each known defect's minimal reproducer)."""
    doc = copy.deepcopy(doc)
    if value is DELETE:
        del get(doc, path[:-1])[path[-1]]
    elif path:
        get(doc, path[:-1])[path[-1]] = value
    else:
        doc = value
    return Mutation(json.dumps(doc, indent=2, ensure_ascii=False), kind, f"{list(path)} -> {value!r}", path)


def write_text(path: Path, text: str) -> None:
    path.write_bytes(text.encode("utf-8", errors="surrogateescape"))


def fresh(scratch: Path, source: Path, names: list[str] | None = None) -> Path:
    """A copy of ``source`` (only ``names`` if given) in ``scratch`` under the same name, replacing
    the last one (the name shows in some outputs: qkv embed's "model")."""
    folder = scratch / source.name
    shutil.rmtree(folder, ignore_errors=True)
    if names is None:
        shutil.copytree(source, folder)
    else:
        folder.mkdir(parents=True)
        for name in names:
            if (source / name).is_file():
                shutil.copy2(source / name, folder / name)
    return folder


# ------------------------------------------------------------------ the files, made by qkv and transformers
SENTENCES = ["3 March 1998", "12/25/04", "the first of May, 2001"]
LM_TEXT = "".join(f"{'To be, or not to be' if i % 3 else 'that is the question'}: line {i}.\n" for i in range(100))
LM_PROMPT = "to be, or"
RUN_FILES = ["config.json", "tokenizer.json", "model.safetensors"]


def translation_result(model, tokenizer, config):
    """What a translation run's files give: teacher-forced logits and greedy translations."""
    src = [tokenizer.encode(s, add_eos=True) for s in SENTENCES]
    tgt = [tokenizer.encode(s[::-1], add_bos=True) for s in SENTENCES]
    pad = lambda rows: torch.tensor([r + [tokenizer.pad_id] * (max(map(len, rows)) - len(r)) for r in rows])  # noqa
    with torch.no_grad():
        logits = model(pad(src), pad(tgt))
        out = greedy_decode(model, pad(src), bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, extra_len=8)
    return {"logits": logits, "text": [tokenizer.decode(ids) for ids in out]}


def lm_result(model, tokenizer, *_):
    """What a language model's files give: logits of the prompt and 6 greedy tokens, decoded."""
    ids = torch.tensor([tokenizer.encode(LM_PROMPT)])
    with torch.no_grad():
        logits = model(ids).logits
        more = model.generate(ids, 6, temperature=0)
    return {"logits": logits, "text": tokenizer.decode(more[0].tolist())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 2-step translation run and a 2-step language-model run (qkv train), their reference
    results, and the text to translate (for qkv translate)."""
    root = tmp_path_factory.mktemp("fuzz_runs")
    src, tgt = write_pairs(root / "data")
    assert main(train_args(src, tgt, root / "translation", "--average-last", "1")) == 0
    (root / "lm.txt").write_text(LM_TEXT, encoding="utf-8")
    lm_args = [
        "train",
        "--task",
        "lm",
        "--train-text",
        root / "lm.txt",
        "--run-dir",
        root / "lm",
        "--max-steps",
        "2",
        "--minutes",
        "0",
        "--no-bf16",
        "--d-model",
        "32",
        "--heads",
        "2",
        "--layers",
        "1",
        "--d-ff",
        "64",
        "--context",
        "16",
        "--max-tokens",
        "256",
        "--no-progress",
        "--threads",
        "1",
    ]
    assert main([str(a) for a in lm_args]) == 0
    (root / "input.txt").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    out = {"root": root, "input": root / "input.txt"}
    for name, make in (("translation", translation_result), ("lm", lm_result)):
        out[name] = root / name
        out[f"{name}_result"] = make(*load_run(root / name))
    code, text, err = run_cli(["translate", root / "translation", root / "input.txt", "--threads", "1"], "translate")
    assert code == 0, err
    out["translate_output"] = text
    code, text, err = run_cli(
        [
            "generate",
            root / "lm",
            "--prompt",
            LM_PROMPT,
            "--max-new-tokens",
            "6",
            "--temperature",
            "0",
            "--threads",
            "1",
        ],
        "generate",
    )
    assert code == 0, err
    out["generate_output"] = text
    out["state"] = torch.load(root / "translation" / "state.pt", weights_only=True, map_location="cpu")
    return out


def read_all(folder: Path, vocab_limit: int | None = None):
    """What a prepared folder gives to training once verified: every pair of every split, the
    text of the validation split, the tokenizer's vocabulary. Where a pair came from
    (``PreparedSplit.where``) must be a string but is not compared: the manifest's ``sources`` are
    provenance for messages, outside the fingerprint, and a source path deleted from them reads
    as ``source:<line>``, which is right."""
    corpus = PreparedCorpus(folder)
    corpus.verify(cache=False)
    tokenizer = corpus.tokenizer()
    out = {"vocab": tokenizer.vocab_size, "splits": {}}
    for name in corpus.manifest["splits"]:
        split = corpus.split(name)
        try:
            src, tgt = split.read(range(len(split)))
            assert not len(split) or isinstance(split.where(0), str)
            out["splits"][name] = (src, tgt, split.lengths().tolist())
            assert all(0 <= i < corpus.manifest["vocab_size"] for ids in (*src, *tgt) for i in ids)
        finally:
            split.close()
    out["text"] = corpus.text("valid", tokenizer).src if corpus.has("valid") else None
    return out


@pytest.fixture(scope="module")
def prepared(runs, tmp_path_factory):
    """A prepared folder (qkv prepare) of 60 train and 20 valid pairs, and what it reads as."""
    root = tmp_path_factory.mktemp("fuzz_prepared")
    src, tgt = write_pairs(root / "data", n=60)
    vsrc, vtgt = write_pairs(root / "data", n=20, seed=5, name="valid")
    args = [
        "prepare",
        "--train-src",
        src,
        "--train-tgt",
        tgt,
        "--val-src",
        vsrc,
        "--val-tgt",
        vtgt,
        "--out",
        root / "prep",
        "--vocab-size",
        "300",
        "--no-progress",
        "--workers",
        "1",
    ]
    assert main([str(a) for a in args]) == 0
    return {
        "folder": root / "prep",
        "result": read_all(root / "prep"),
        "manifest": json.loads((root / "prep" / "manifest.json").read_text(encoding="utf-8")),
    }


GPT2_CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "Attention is all you need; the transformer attends to every token before it.",
] * 5
BERT_WORDS = [
    "the",
    "a",
    "dog",
    "cat",
    "runs",
    "sleeps",
    "on",
    "mat",
    "time",
    "flies",
    "like",
    "an",
    "arrow",
    "fruit",
    "banana",
    "##s",
    "##ing",
    ",",
    ".",
]
BERT_TEXTS = ["time flies like an arrow", "the dog runs on the mat", "fruit flies like a banana ."]


def pretrained_result(model):
    """What a Hugging Face folder gives: GPT-2: prompt logits and 6 greedy tokens, decoded;
    BERT: the hidden states and pooler output of three sentences."""
    with torch.no_grad():
        if isinstance(model, qkv.CausalLM):
            ids = torch.tensor([model.tokenizer.encode("The quick brown")])
            more = model.generate(ids, 6, temperature=0)[0]
            return {"logits": model(ids).logits, "text": model.tokenizer.decode(more)}
        batch = model.tokenizer(BERT_TEXTS)
        out = model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
        return {"hidden": out.last_hidden_state, "pooled": out.pooler_output, "ids": batch.input_ids}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tiny GPT-2 (GPT2LMHeadModel) and a tiny BERT (BertModel) saved with save_pretrained
    (safetensors) with their tokenizers, and what qkv.load_pretrained gives for each."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("fuzz_hf")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        GPT2_CORPUS,
        trainers.BpeTrainer(
            vocab_size=300,
            min_frequency=1,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    torch.manual_seed(1)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=bpe.get_vocab_size(),
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )
    gpt2.save_pretrained(str(root / "gpt2"))
    bpe.save(str(root / "gpt2" / "tokenizer.json"))

    (root / "bert").mkdir()
    vocab = root / "bert" / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *BERT_WORDS]) + "\n", encoding="utf-8")
    transformers.BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(str(root / "bert"))
    torch.manual_seed(1)
    bert = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=len(BERT_WORDS) + 5,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            max_position_embeddings=40,
            type_vocab_size=2,
            initializer_range=0.3,
        )
    )
    bert.save_pretrained(str(root / "bert"))
    out = {"transformers": transformers, "root": root}
    for name in ("gpt2", "bert"):
        out[name] = root / name
        out[f"{name}_result"] = pretrained_result(qkv.load_pretrained(root / name, device="cpu"))
        out[f"{name}_config"] = json.loads((root / name / "config.json").read_text(encoding="utf-8"))
    code, text, err = run_cli(["embed", "time flies like an arrow", "--model", root / "bert"], "embed")
    assert code == 0, err
    out["embed_output"] = text
    return out


# ================================================================== run folders
def safetensors_regions(data: bytes) -> tuple[int, list[tuple[int, int]]]:
    """(where the tensor data starts, [header, data] regions) of a safetensors file."""
    start = 8 + int.from_bytes(data[:8], "little")
    return start, [(0, 8), (0, start), (start, len(data))]


def tensor_entries(data: bytes):
    """A safetensors file's tensor entries (names, dtypes, shapes, offsets: all but the free-form
    ``__metadata__``), or None when its header cannot be read."""
    try:
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + size].decode("utf-8"))
        header.pop("__metadata__", None)
        return header
    except (ValueError, AttributeError, TypeError):
        return None


def data_only(original: bytes, mutated: bytes) -> bool:
    """Only tensor DATA changed: the same size and tensor entries (the metadata may differ)."""
    entries = tensor_entries(original)
    return len(mutated) == len(original) and entries is not None and tensor_entries(mutated) == entries


# The known defects' region of a run's config.json, left out of the main tests until fixed:
# a model field deleted (test_deleted_model_field_is_refused), a model field of
# the wrong type that qkv does not check (test_model_fields_of_the_wrong_type_are_refused).
UNTYPED_MODEL_FIELDS = (
    "layer_norm_eps",
    "dropout",
    "attention_dropout",
    "pad_id",
    "norm_first",
    "share_embeddings",
    "tie_output",
    "bias",
    "scale_embedding",
)


def run_config_known_bug(m: Mutation) -> bool:
    """No known defect is left in a run's config.json (kept as the hook for the next one)."""
    return False


@pytest.mark.parametrize("kind", ["translation", "lm"])
def test_run_config_json(runs, kind, tmp_path, record_property):
    """A run's config.json through load_run: refused in one line, or read as it says (a mutation
    that keeps the meaning, gives a value of the wrong type, deletes or adds a key: the reference
    result; another value of the right type: any finite result). The known defects' region
    (:func:`run_config_known_bug`) is left out until they are fixed."""
    tally = Tally(f"{kind} run config.json (load_run)")
    doc = json.loads((runs[kind] / "config.json").read_text(encoding="utf-8"))

    @fuzz(150)
    @given(json_mutations(doc, skip=run_config_known_bug))
    def mutate(mutation):
        text, what_kind, what, _ = mutation
        note(what)
        check_run_config(runs, kind, fresh(tmp_path, runs[kind], RUN_FILES), text, what_kind, tally)

    mutate()
    tally.report(record_property)


# The known defects' regions of the tokenizer files, left out of the main tests until fixed: a
# language model's chars (test_lm_chars_edit_is_refused); what makes the
# tokenizers library panic or fail at use (test_tokenizer_panics_and_use_errors_are_one_line).
TOKENIZER_KNOWN_BUGS = {"translation": [], "lm": [], "gpt2": [], "bert": []}  # none left


def special_id_past_vocab(m: Mutation) -> bool:
    """A post-processor special token's id past the WordPiece vocabulary: the known defect of
    :func:`test_bert_special_token_id_past_the_vocabulary_is_refused`."""
    try:
        data = json.loads(m.text)
        size = len(data["model"]["vocab"])
        return any(
            isinstance(i, int) and i >= size
            for token in data["post_processor"]["special_tokens"].values()
            for i in token["ids"]
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        return False


def wordpiece_unk_missing(m: Mutation) -> bool:
    """The WordPiece model's unk_token is not in its vocabulary (the same known defect)."""
    try:
        model = json.loads(m.text)["model"]
        return model["unk_token"] not in model["vocab"]
    except (ValueError, TypeError, KeyError):
        return False


@pytest.mark.parametrize("kind", ["translation", "lm"])
def test_run_tokenizer_json(runs, kind, tmp_path, record_property):
    """A run's tokenizer.json (byte-level BPE; a language model's: characters) through load_run.
    The :data:`TOKENIZER_KNOWN_BUGS` regions are left out until those defects are fixed."""
    tally = Tally(f"{kind} run tokenizer.json (load_run)")
    doc = json.loads((runs[kind] / "tokenizer.json").read_text(encoding="utf-8"))
    exclude = TOKENIZER_KNOWN_BUGS[kind]

    @fuzz(150)
    @given(json_mutations(doc, exclude=exclude))
    def mutate(mutation):
        text, what_kind, what, _ = mutation
        note(what)
        folder = fresh(tmp_path, runs[kind], RUN_FILES)
        write_text(folder / "tokenizer.json", text)
        make = translation_result if kind == "translation" else lm_result
        outcome, value = attempt(lambda: make(*load_run(folder)), folder, "tokenizer.json")
        if outcome == "refused":
            judge_refused(what_kind, tally)
        else:
            judge_loaded(value, runs[f"{kind}_result"], what_kind, {"neutral", "retype"}, tally)

    mutate()
    tally.report(record_property)


@pytest.mark.parametrize("kind", ["translation", "lm"])
def test_run_model_safetensors(runs, kind, tmp_path, record_property):
    """A run's model.safetensors through load_run. safetensors has no checksum: a change inside
    the tensor DATA bytes loads as another weight, which is the only change that may load with
    a different result; any change to the header (the first 8 bytes and the JSON) or to the
    size must be refused or load the same tensors."""
    tally = Tally(f"{kind} run model.safetensors (load_run)")
    data = (runs[kind] / "model.safetensors").read_bytes()
    start, regions = safetensors_regions(data)

    @fuzz(150)
    @given(byte_mutations(len(data), regions))
    def mutate(ops):
        note(f"data starts at {start}; ops {ops}")
        folder = fresh(tmp_path, runs[kind], RUN_FILES)
        mutated, _ = apply_bytes(data, ops)
        (folder / "model.safetensors").write_bytes(mutated)
        make = translation_result if kind == "translation" else lm_result
        outcome, value = attempt(lambda: make(*load_run(folder)), folder, "model.safetensors")
        if outcome == "refused":
            judge_refused("neutral" if mutated == data else "changed", tally)
            return
        judge_weights(value, runs[f"{kind}_result"], data_only(data, mutated), tally)

    mutate()
    tally.report(record_property)


class ZipLayout(NamedTuple):
    central: int  # where the central directory starts
    end_records: int  # where its entries end: the (zip64) end records follow
    payloads: list[tuple[int, int]]  # [start, end) of each member's contents
    largest_attr: int  # the external attributes of the largest member's central directory entry


def zip_layout(data: bytes) -> ZipLayout:
    """The layout of a zip (state.pt: a pickle and one record per tensor storage)."""
    payloads, entries = [], {}
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for info in archive.infolist():
            at = info.header_offset
            name_len, extra_len = struct.unpack("<HH", data[at + 26 : at + 30])
            start = at + 30 + name_len + extra_len
            payloads.append((start, start + info.compress_size))
            entries[info.filename] = start
        central = archive.start_dir
    at, largest, biggest = central, 0, -1
    while data[at : at + 4] == b"PK\x01\x02":
        size = struct.unpack("<I", data[at + 20 : at + 24])[0]
        name_len, extra_len, comment_len = struct.unpack("<HHH", data[at + 28 : at + 34])
        if size > biggest:
            largest, biggest = at + 38, size
        at += 46 + name_len + extra_len + comment_len
    return ZipLayout(central, at, sorted(payloads), largest)


def test_state_pt(runs, tmp_path, record_property):
    """state.pt (a torch zip) through load_checkpoint: refused in one line, or the same state.
    Truncation, insertion and deletion anywhere; bytes changed in place only in the end records
    (after the central directory's entries). A byte changed in place before (a member's contents;
    a local header's lengths, which say where the contents begin; a central directory entry's
    sizes or attributes) is the known defect of
    :func:`test_state_pt_changed_bytes_are_refused`."""
    tally = Tally("translation run state.pt (load_checkpoint)")
    data = (runs["translation"] / "state.pt").read_bytes()
    layout = zip_layout(data)

    @fuzz(150)
    @given(
        byte_mutations(
            len(data), [(0, len(data))], resize_regions=[(0, 256), (0, len(data)), (layout.central, len(data))]
        )
    )
    def mutate(ops):
        note(f"{layout}; ops {ops}")
        mutated, _ = apply_bytes(data, ops)
        folder = fresh(tmp_path, runs["translation"], ["state.pt", "last.safetensors"])
        (folder / "state.pt").write_bytes(mutated)
        outcome, value = attempt(lambda: load_checkpoint(folder, clean=False), folder, "state.pt")
        if outcome == "refused":
            judge_refused("neutral" if mutated == data else "changed", tally)
        else:
            assert same(value, runs["state"]), "load_checkpoint gave another state (a silent wrong result)"
            tally("loaded, same result")

    mutate()
    tally.report(record_property)


def test_state_pt_changed_bytes_are_refused(runs, tmp_path):
    data = (runs["translation"] / "state.pt").read_bytes()
    layout = zip_layout(data)
    largest = max(layout.payloads, key=lambda r: r[1] - r[0])

    @fuzz(30)
    @given(byte_mutations(len(data), [*layout.payloads, (0, layout.end_records)], resizing=False))
    @example([("flip", (largest[0] + largest[1]) // 2 + 3, 0x40)])  # an exponent bit of a float32
    @example([("set", layout.largest_attr, 0x10)])  # the MS-DOS directory bit of the largest member
    def mutate(ops):
        note(f"ops {ops}")
        folder = fresh(tmp_path, runs["translation"], ["state.pt", "last.safetensors"])
        (folder / "state.pt").write_bytes(apply_bytes(data, ops)[0])
        outcome, value = attempt(lambda: load_checkpoint(folder, clean=False), folder, "state.pt")
        assert outcome == "refused" or same(value, runs["state"]), "load_checkpoint gave another state"

    mutate()


def test_cli_translate_config_json(runs, tmp_path, record_property):
    """config.json through ``qkv translate``: exit 0 with the reference translation (any output
    for an edited value), or exit 2 with one line naming the file. The ``decode`` section is
    left out until :func:`test_translate_decode_section_is_checked` is fixed."""
    tally = Tally("translation run config.json (qkv translate)")
    doc = json.loads((runs["translation"] / "config.json").read_text(encoding="utf-8"))

    @fuzz(60)
    @given(json_mutations(doc, skip=run_config_known_bug))
    def mutate(mutation):
        text, what_kind, what, _ = mutation
        note(what)
        folder = fresh(tmp_path, runs["translation"], RUN_FILES)
        write_text(folder / "config.json", text)
        code, out, err = run_cli(["translate", folder, runs["input"], "--threads", "1"], "translate")
        judge_cli(
            code,
            out,
            err,
            folder,
            "translate",
            runs["translate_output"],
            what_kind in {"neutral", "retype", "delete", "add"},
            tally,
            what_kind,
        )

    mutate()
    tally.report(record_property)


def test_translate_decode_section_is_checked(runs, tmp_path):
    doc = json.loads((runs["translation"] / "config.json").read_text(encoding="utf-8"))

    @fuzz(30)
    @given(json_mutations(doc, start=[("decode",)]))
    @example(edited(doc, ("decode", "beam_size"), "5"))
    def mutate(mutation):
        text, what_kind, what, _ = mutation
        note(what)
        folder = fresh(tmp_path, runs["translation"], RUN_FILES)
        write_text(folder / "config.json", text)
        code, out, err = run_cli(["translate", folder, runs["input"], "--threads", "1"], "translate")
        judge_cli(
            code, out, err, folder, "translate", runs["translate_output"], what_kind != "revalue", Tally("decode")
        )

    mutate()


def test_cli_generate_config_json(runs, tmp_path, record_property):
    """A language-model run's config.json through ``qkv generate`` (greedy, 6 tokens)."""
    tally = Tally("lm run config.json (qkv generate)")
    doc = json.loads((runs["lm"] / "config.json").read_text(encoding="utf-8"))

    @fuzz(60)
    @given(json_mutations(doc, skip=run_config_known_bug))
    def mutate(mutation):
        text, what_kind, what, _ = mutation
        note(what)
        folder = fresh(tmp_path, runs["lm"], RUN_FILES)
        write_text(folder / "config.json", text)
        code, out, err = run_cli(
            [
                "generate",
                folder,
                "--prompt",
                LM_PROMPT,
                "--max-new-tokens",
                "6",
                "--temperature",
                "0",
                "--threads",
                "1",
            ],
            "generate",
        )
        judge_cli(
            code,
            out,
            err,
            folder,
            "generate",
            runs["generate_output"],
            what_kind in {"neutral", "retype", "delete", "add"},
            tally,
            what_kind,
        )

    mutate()
    tally.report(record_property)


def check_run_config(runs, kind: str, folder: Path, text: str, what_kind: str, tally: Tally) -> None:
    """One config.json mutation through load_run, judged as in :func:`test_run_config_json`."""
    write_text(folder / "config.json", text)
    make = translation_result if kind == "translation" else lm_result
    outcome, value = attempt(lambda: make(*load_run(folder)), folder, "config.json")
    if outcome == "refused":
        judge_refused(what_kind, tally)
    else:
        judge_loaded(value, runs[f"{kind}_result"], what_kind, {"neutral", "retype", "delete", "add"}, tally)


@pytest.mark.parametrize(
    "kind, field, value",
    [("translation", "layer_norm_eps", True), ("lm", "scale_embedding", 1), ("gpt2", "layer_norm_epsilon", True)],
)
def test_model_fields_of_the_wrong_type_are_refused(runs, hf, kind, field, value, tmp_path):
    source = hf["gpt2"] if kind == "gpt2" else runs[kind]
    doc = json.loads((source / "config.json").read_text(encoding="utf-8"))
    fields = [(field,)] if kind == "gpt2" else [("model", f) for f in UNTYPED_MODEL_FIELDS if f in doc["model"]]

    @fuzz(30)
    @given(json_mutations(doc, start=fields, skip=lambda m: m.kind != "retype"))
    @example(edited(doc, fields[0][:-1] + (field,), value))
    def mutate(mutation):
        note(mutation.what)
        folder = fresh(tmp_path, source, None if kind == "gpt2" else RUN_FILES)
        if kind == "gpt2":
            check_pretrained_config(hf, "gpt2", folder, mutation.text, mutation.kind, Tally("types"))
        else:
            check_run_config(runs, kind, folder, mutation.text, mutation.kind, Tally("types"))

    mutate()


def test_deleted_model_field_is_refused(runs, tmp_path):
    doc = json.loads((runs["translation"] / "config.json").read_text(encoding="utf-8"))

    @fuzz(30)
    @given(json_mutations(doc, start=[("model", f) for f in doc["model"]], skip=lambda m: "deleted" not in m.what))
    @example(edited(doc, ("model", "num_heads"), DELETE, "delete"))
    def mutate(mutation):
        note(mutation.what)
        folder = fresh(tmp_path, runs["translation"], RUN_FILES)
        check_run_config(runs, "translation", folder, mutation.text, mutation.kind, Tally("deleted"))

    mutate()


def test_lm_chars_edit_is_refused(runs, tmp_path):
    doc = json.loads((runs["lm"] / "tokenizer.json").read_text(encoding="utf-8"))

    @fuzz(30)
    @given(json_mutations(doc, start=[("chars",)]))
    @example(edited(doc, ("chars",), ""))
    def mutate(mutation):
        text, what_kind, what, _ = mutation
        note(what)
        folder = fresh(tmp_path, runs["lm"], RUN_FILES)
        write_text(folder / "tokenizer.json", text)
        outcome, value = attempt(lambda: lm_result(*load_run(folder)), folder, "tokenizer.json")
        if outcome == "loaded":
            judge_loaded(
                value, runs["lm_result"], what_kind, {"neutral", "retype", "revalue", "delete", "add"}, Tally("chars")
            )

    mutate()


# ================================================================== prepared folders
def refingerprint(manifest) -> None:
    """Make an edited manifest's fingerprint that of its hashes again (as a deliberate edit would),
    so the checks after the fingerprint's are reached; leaves a manifest it cannot do that for."""
    with contextlib.suppress(KeyError, TypeError, ValueError):
        manifest["fingerprint"] = folder_fingerprint(manifest["tokenizer_sha256"], manifest["splits"])


def test_prepared_arrays(prepared, tmp_path, record_property):
    """A prepared folder's arrays and tokenizer.json, changed at the byte level, through
    PreparedCorpus.verify: every change is refused (SHA-256); with ``rehash`` the manifest is given
    the changed file's hash and a matching fingerprint (a deliberate edit), and then the folder
    is refused in one line, or verified and every pair reads with ids inside the vocabulary."""
    tally = Tally("prepared arrays + tokenizer.json (PreparedCorpus.verify, read)")
    source = prepared["folder"]
    files = [f for split in ("train", "valid") for f in split_files(split)] + ["tokenizer.json"]
    contents = {name: (source / name).read_bytes() for name in files}

    @fuzz(200)
    @given(
        st.sampled_from(files).flatmap(
            lambda name: st.tuples(st.just(name), byte_mutations(len(contents[name])), st.booleans())
        )
    )
    def mutate(case):
        name, ops, rehash = case
        note(f"{name}: {ops}; rehash {rehash}")
        folder = fresh(tmp_path, source)
        mutated, _ = apply_bytes(contents[name], ops)
        (folder / name).write_bytes(mutated)
        if rehash:
            manifest = copy.deepcopy(prepared["manifest"])
            digest = hashlib.sha256(mutated).hexdigest()
            if name == "tokenizer.json":
                manifest["tokenizer_sha256"] = digest
            else:
                manifest["splits"][name.split(".")[0]]["sha256"][name] = digest
            refingerprint(manifest)
            (folder / "manifest.json").write_text(json.dumps(manifest, indent=2), encoding="utf-8")
        outcome, value = attempt(lambda: read_all(folder), folder, name)
        if outcome == "refused":
            judge_refused("neutral" if mutated == contents[name] else "changed", tally)
        elif mutated == contents[name]:
            assert same(value, prepared["result"])
            tally("loaded, same bytes")
        else:
            assert rehash, f"{name} changed and its hash still verified"
            tally("loaded, deliberate edit (rehashed) read in vocabulary")

    mutate()
    tally.report(record_property)


def test_prepared_manifest(prepared, tmp_path, record_property):
    """manifest.json through PreparedCorpus, verify and reading every pair: refused in one line,
    or the same pairs, text and vocabulary (the arrays are hashed: a manifest edit may not change
    what is read). Half the mutations get a matching fingerprint (a deliberate edit)."""
    tally = Tally("prepared manifest.json (PreparedCorpus, verify, read)")

    @fuzz(200)
    @given(json_mutations(prepared["manifest"]), st.booleans())
    def mutate(mutation, deliberate):
        text, what_kind, what, _ = mutation
        note(f"{what}; refingerprinted {deliberate}")
        folder = fresh(tmp_path, prepared["folder"])
        if deliberate and what_kind != "raw":
            manifest = json.loads(text)
            if isinstance(manifest, dict):
                refingerprint(manifest)
                text = json.dumps(manifest, indent=2)
        write_text(folder / "manifest.json", text)
        outcome, value = attempt(lambda: read_all(folder), folder, "manifest.json")
        if outcome == "refused":
            judge_refused(what_kind, tally)
            return
        reference = prepared["result"]
        # a deliberate edit may leave a split out (its fingerprint says so); what is read is the reference
        kept = {name: reference["splits"][name] for name in value["splits"] if name in reference["splits"]}
        text = reference["text"] if "valid" in value["splits"] else None
        assert same(value, {**reference, "splits": kept, "text": text}), (
            "the prepared folder read differently after a manifest edit"
        )
        assert kept.keys() == reference["splits"].keys() or deliberate, "a split vanished without a word"
        tally("loaded, same result" if kept.keys() == reference["splits"].keys() else "loaded, a split left out")

    mutate()
    tally.report(record_property)


def test_manifest_sources_of_another_type_are_refused(prepared, tmp_path):
    @fuzz(30)
    @given(json_mutations(prepared["manifest"], start=[("sources",)]))
    @example(edited(prepared["manifest"], ("sources",), []))
    def mutate(mutation):
        text, what_kind, what, _ = mutation
        note(what)
        folder = fresh(tmp_path, prepared["folder"])
        write_text(folder / "manifest.json", text)
        attempt(lambda: read_all(folder), folder, "manifest.json")

    mutate()


def test_prepared_hash_cache(prepared, tmp_path, record_property):
    """verified.json (the hash cache) mutated: it only saves time, so the folder still verifies
    and reads the same, whatever the cache holds (never an error, never a pass for a changed file)."""
    tally = Tally("prepared verified.json (PreparedCorpus.verify with the cache)")
    folder = tmp_path / "cached"
    shutil.copytree(prepared["folder"], folder)
    old = 1_600_000_000
    for path in folder.iterdir():
        os.utime(path, (old, old))  # older than the racy window: their hashes are kept
    PreparedCorpus(folder).verify()
    cache = json.loads((folder / "verified.json").read_text(encoding="utf-8"))
    assert len(cache["files"]) == 13

    @fuzz(100)
    @given(json_mutations(cache))
    def mutate(mutation):
        text, what_kind, what, _ = mutation
        note(what)
        write_text(folder / "verified.json", text)

        def verify_and_read():
            PreparedCorpus(folder).verify()
            return read_all(folder)

        outcome, value = attempt(verify_and_read, folder, "verified.json")
        assert outcome == "loaded", f"a mutated hash cache made verify fail: {value}"
        assert same(value, prepared["result"])
        tally("loaded, same result")

    mutate()
    tally.report(record_property)


# ================================================================== Hugging Face folders
def hf_fields(model) -> dict:
    """The configuration qkv built a pretrained model with, in Hugging Face's field names."""
    c = model.config
    if isinstance(model, qkv.CausalLM):
        return {
            "vocab_size": c.vocab_size,
            "n_embd": c.d_model,
            "n_head": c.num_heads,
            "n_layer": c.num_layers,
            "n_inner": c.d_ff,
            "n_positions": c.context,
            "activation": c.activation,
            "layer_norm_epsilon": c.layer_norm_eps,
            "tie_word_embeddings": c.tie_output,
        }
    return {
        name: getattr(c, name)
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "hidden_act",
            "max_position_embeddings",
            "type_vocab_size",
            "layer_norm_eps",
        )
    }


def transformers_fields(transformers, family: str, data: dict) -> dict | None:
    """The same fields as ``transformers`` reads them from ``data`` (None: it refuses the config)."""
    from qkv.pretrained.gpt2 import GPT2_ACTIVATIONS

    try:
        if family == "gpt2":
            c = transformers.GPT2Config.from_dict(data)
            return {
                "vocab_size": c.vocab_size,
                "n_embd": c.n_embd,
                "n_head": c.n_head,
                "n_layer": c.n_layer,
                "n_inner": c.n_inner if c.n_inner is not None else 4 * c.n_embd,
                "n_positions": c.n_positions,
                "activation": GPT2_ACTIVATIONS.get(c.activation_function),
                "layer_norm_epsilon": c.layer_norm_epsilon,
                "tie_word_embeddings": c.tie_word_embeddings,
            }
        c = transformers.BertConfig.from_dict(data)
        return {
            name: getattr(c, name)
            for name in (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "intermediate_size",
                "hidden_act",
                "max_position_embeddings",
                "type_vocab_size",
                "layer_norm_eps",
            )
        }
    except Exception:  # noqa: BLE001 - transformers refuses a config with many types
        return None


# BertConfig's sizes, dropouts, epsilon and padding id: read without checking their types and
# ranges (test_bert_config_values_are_checked), left out of the main BERT tests.
BERT_UNCHECKED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "max_position_embeddings",
    "type_vocab_size",
    "layer_norm_eps",
    "pad_token_id",
)


def check_pretrained_config(hf, family: str, folder: Path, text: str, what_kind: str, tally: Tally) -> None:
    """A Hugging Face config.json's mutation through qkv.load_pretrained: refused in one line, or
    loaded with every field equal to what transformers reads from the same file (its defaults for
    a deleted key) and finite outputs; the reference outputs when the meaning is kept or when
    transformers itself refuses the file (a value of the wrong type)."""
    write_text(folder / "config.json", text)
    outcome, value = attempt(
        lambda: (m := qkv.load_pretrained(folder, device="cpu"), pretrained_result(m)), folder, "config.json"
    )
    if outcome == "refused":
        judge_refused(what_kind, tally)
        return
    model, result = value
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    theirs = transformers_fields(hf["transformers"], family, data) if isinstance(data, dict) else None
    if theirs is None or what_kind == "neutral":
        kind = what_kind if what_kind == "neutral" else "value transformers refuses"
        judge_loaded(result, hf[f"{family}_result"], kind, {kind}, tally)
    else:
        ours = hf_fields(model)
        assert ours == theirs, f"qkv read {ours}, transformers {theirs}"
        judge_loaded(result, hf[f"{family}_result"], what_kind, set(), tally)


GPT2_SIZES = ("vocab_size", "n_embd", "n_head", "n_layer", "n_inner", "n_positions")
HUGE = 10**6  # a size above this in a tiny model's config: beyond any weights file here


def gpt2_config_known_bug(m: Mutation) -> bool:
    """The known defects' region of a GPT-2 config.json: layer_norm_epsilon of the wrong type
    (:func:`test_model_fields_of_the_wrong_type_are_refused`), a huge size
    (:func:`test_gpt2_huge_sizes_are_refused_before_building`)."""
    if m.kind == "retype" and m.path == ("layer_norm_epsilon",):
        return True
    try:
        data = json.loads(m.text)
    except ValueError:
        return False
    return isinstance(data, dict) and any(type(data.get(f)) is int and data[f] > HUGE for f in GPT2_SIZES)


def test_gpt2_huge_sizes_are_refused_before_building(hf, tmp_path):
    doc = hf["gpt2_config"]

    @fuzz(20)
    @given(json_mutations(doc, start=[(f,) for f in GPT2_SIZES], skip=lambda m: not gpt2_config_known_bug(m)))
    @example(edited(doc, ("n_positions",), 2**63, "revalue"))
    def mutate(mutation):
        note(mutation.what)
        check_pretrained_config(hf, "gpt2", fresh(tmp_path, hf["gpt2"]), mutation.text, mutation.kind, Tally("huge"))

    mutate()


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_pretrained_config_json(hf, family, tmp_path, record_property):
    """A Hugging Face config.json through qkv.load_pretrained (see :func:`check_pretrained_config`).
    BERT's :data:`BERT_UNCHECKED` fields are left out until
    :func:`test_bert_config_values_are_checked` is fixed, GPT-2's
    :func:`gpt2_config_known_bug` region until its two defects are."""
    tally = Tally(f"{family} config.json (load_pretrained)")
    exclude, skip = [], None  # the known defects these left out are fixed

    @fuzz(150)
    @given(json_mutations(hf[f"{family}_config"], exclude=exclude, skip=skip))
    def mutate(mutation):
        text, what_kind, what, _ = mutation
        note(what)
        check_pretrained_config(hf, family, fresh(tmp_path, hf[family]), text, what_kind, tally)

    mutate()
    tally.report(record_property)


def test_bert_config_values_are_checked(hf, tmp_path):
    @fuzz(40)
    @given(json_mutations(hf["bert_config"], start=[(name,) for name in BERT_UNCHECKED]))
    @example(edited(hf["bert_config"], ("max_position_embeddings",), True))
    def mutate(mutation):
        text, what_kind, what, _ = mutation
        note(what)
        check_pretrained_config(hf, "bert", fresh(tmp_path, hf["bert"]), text, what_kind, Tally("bert config"))

    mutate()


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_pretrained_model_safetensors(hf, family, tmp_path, record_property):
    """A Hugging Face model.safetensors through qkv.load_pretrained (no checksum: only a change
    inside the tensor DATA bytes may load, as another weight)."""
    tally = Tally(f"{family} model.safetensors (load_pretrained)")
    data = (hf[family] / "model.safetensors").read_bytes()
    start, regions = safetensors_regions(data)

    @fuzz(150)
    @given(byte_mutations(len(data), regions))
    def mutate(ops):
        note(f"data starts at {start}; ops {ops}")
        folder = fresh(tmp_path, hf[family])
        mutated, _ = apply_bytes(data, ops)
        (folder / "model.safetensors").write_bytes(mutated)
        outcome, value = attempt(
            lambda: pretrained_result(qkv.load_pretrained(folder, device="cpu")), folder, "model.safetensors"
        )
        if outcome == "refused":
            judge_refused("neutral" if mutated == data else "changed", tally)
            return
        judge_weights(value, hf[f"{family}_result"], data_only(data, mutated), tally)

    mutate()
    tally.report(record_property)


@pytest.mark.parametrize("family, name", [("gpt2", "tokenizer.json"), ("bert", "tokenizer.json")])
def test_pretrained_tokenizer(hf, family, name, tmp_path, record_property):
    """A Hugging Face tokenizer file through qkv.load_pretrained, then used (encode, run, decode):
    refused in one line, or the same outputs when the meaning is kept, finite ones for an edit.
    The :data:`TOKENIZER_KNOWN_BUGS` regions are left out until those defects are fixed."""
    tally = Tally(f"{family} {name} (load_pretrained)")
    doc = json.loads((hf[family] / name).read_text(encoding="utf-8"))

    @fuzz(100)
    @given(json_mutations(doc, exclude=TOKENIZER_KNOWN_BUGS[family]))
    def mutate(mutation):
        text, what_kind, what, _ = mutation
        note(what)
        folder = fresh(tmp_path, hf[family])
        write_text(folder / name, text)
        outcome, value = attempt(lambda: pretrained_result(qkv.load_pretrained(folder, device="cpu")), folder, name)
        if outcome == "refused":
            judge_refused(what_kind, tally)
        else:
            judge_loaded(value, hf[f"{family}_result"], what_kind, {"neutral", "retype"}, tally)

    mutate()
    tally.report(record_property)


@pytest.mark.parametrize(
    "kind, path, value",
    [
        ("translation", ("model", "continuing_subword_prefix"), "true"),  # PanicException while loading
        ("gpt2", ("model", "continuing_subword_prefix"), "true"),  # PanicException while loading
        ("bert", ("post_processor", "special_tokens", "[CLS]"), DELETE),  # PanicException at the first encode
        ("bert", ("model", "unk_token"), "relu"),  # Exception at the first encode of an unknown word
    ],
)
def test_tokenizer_panics_and_use_errors_are_one_line(runs, hf, kind, path, value, tmp_path):
    source = runs[kind] if kind == "translation" else hf[kind]
    doc = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))

    @fuzz(20)
    @given(json_mutations(doc, start=[path[:2]]))
    @example(edited(doc, path, value, "delete" if value is DELETE else "revalue"))
    def mutate(mutation):
        note(mutation.what)
        folder = fresh(tmp_path, source, RUN_FILES if kind == "translation" else None)
        write_text(folder / "tokenizer.json", mutation.text)
        if kind == "translation":
            call = lambda: translation_result(*load_run(folder))  # noqa: E731
        else:
            call = lambda: pretrained_result(qkv.load_pretrained(folder, device="cpu"))  # noqa: E731
        outcome, result = attempt(call, folder, "tokenizer.json")
        if outcome == "loaded":
            judge_loaded(
                result,
                runs[f"{kind}_result"] if kind == "translation" else hf[f"{kind}_result"],
                mutation.kind,
                {"neutral", "retype"},
                Tally("tokenizer"),
            )

    mutate()


def max_length_not_finite(m: Mutation) -> bool:
    """tokenizer_config.json's model_max_length is Infinity or NaN: the known defect of
    :func:`test_bert_model_max_length_infinity_is_refused`."""
    try:
        value = json.loads(m.text).get("model_max_length")
    except (ValueError, AttributeError):
        return False
    return isinstance(value, float) and not math.isfinite(value)


def test_bert_model_max_length_infinity_is_refused(hf, tmp_path):
    name = "tokenizer_config.json"
    doc = json.loads((hf["bert"] / name).read_text(encoding="utf-8"))

    @fuzz(20)
    @given(json_mutations(doc, start=[("model_max_length",)], skip=lambda m: not max_length_not_finite(m)))
    @example(edited(doc, ("model_max_length",), float("inf")))
    def mutate(mutation):
        note(mutation.what)
        folder = fresh(tmp_path, hf["bert"])
        write_text(folder / name, mutation.text)
        outcome, value = attempt(lambda: pretrained_result(qkv.load_pretrained(folder, device="cpu")), folder, name)
        if outcome == "loaded":
            judge_loaded(value, hf["bert_result"], mutation.kind, {"neutral", "retype"}, Tally(name))

    mutate()


def test_bert_special_token_id_past_the_vocabulary_is_refused(hf, tmp_path):
    doc = json.loads((hf["bert"] / "tokenizer.json").read_text(encoding="utf-8"))

    @fuzz(20)
    @given(
        json_mutations(doc, start=[("post_processor", "special_tokens")], skip=lambda m: not special_id_past_vocab(m))
    )
    @example(edited(doc, ("post_processor", "special_tokens", "[CLS]", "ids"), [10**9], "revalue"))
    def mutate(mutation):
        note(mutation.what)
        folder = fresh(tmp_path, hf["bert"])
        write_text(folder / "tokenizer.json", mutation.text)
        outcome, value = attempt(
            lambda: pretrained_result(qkv.load_pretrained(folder, device="cpu")), folder, "tokenizer.json"
        )
        if outcome == "loaded":
            judge_loaded(value, hf["bert_result"], mutation.kind, {"neutral", "retype"}, Tally("special tokens"))

    mutate()


def test_bert_tokenizer_config_is_checked(hf, tmp_path):
    name = "tokenizer_config.json"
    doc = json.loads((hf["bert"] / name).read_text(encoding="utf-8"))

    @fuzz(40)
    @given(json_mutations(doc, start=[(), ("model_max_length",)]))
    @example(edited(doc, (), None))
    def mutate(mutation):
        text, what_kind, what, _ = mutation
        note(what)
        folder = fresh(tmp_path, hf["bert"])
        write_text(folder / name, text)
        outcome, value = attempt(lambda: pretrained_result(qkv.load_pretrained(folder, device="cpu")), folder, name)
        if outcome == "loaded":
            judge_loaded(value, hf["bert_result"], what_kind, {"neutral", "retype"}, Tally(name))

    mutate()


def test_cli_embed_config_json(hf, tmp_path, record_property):
    """A BERT config.json through ``qkv embed``: exit 0 (the reference embedding when the meaning
    is kept) or exit 2 with one line naming the file."""
    tally = Tally("bert config.json (qkv embed)")

    @fuzz(60)
    @given(json_mutations(hf["bert_config"]))
    def mutate(mutation):
        text, what_kind, what, _ = mutation
        note(what)
        folder = fresh(tmp_path, hf["bert"])
        write_text(folder / "config.json", text)
        code, out, err = run_cli(["embed", "time flies like an arrow", "--model", folder], "embed")
        judge_cli(code, out, err, folder, "embed", hf["embed_output"], what_kind == "neutral", tally, what_kind)

    mutate()
    tally.report(record_property)
