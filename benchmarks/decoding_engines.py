"""Decoding speed of qkv and of the engines it exports to, side by side in one run, each with its BLEU.

One command exports a translation run (Hugging Face Marian, ONNX, CTranslate2 float32 and int8) into a
folder under /tmp, then decodes the run's test set (Multi30k: test 2016) with

    qkv_greedy, qkv_beam (beam 5, the power length penalty, len ** alpha, as HF and CTranslate2 rank),
    hf_greedy, hf_beam (``generate`` on the exported MarianMTModel),
    ct2_float32_greedy, ct2_float32_beam, ct2_int8_greedy, ct2_int8_beam,
    onnxruntime_greedy (qkv's ONNX export with its greedy loop),
    and, with --with-gnmt, qkv_beam_gnmt (qkv's default length penalty, ((5 + len) / 6) ** alpha)

at every --threads count (torch.set_num_threads, CTranslate2's intra_threads, onnxruntime's
intra_op_num_threads). Every engine gets the same batches: the sentences sorted by length and cut
into batches of --batch-size sentences (16), and the same length limit per batch (the longest source
+ 50 tokens, capped by the positional table). To keep the run short only about --timed-sentences
sentences (240: 15 of the batches, spread evenly from the shortest to the longest) are timed; BLEU
(sacreBLEU, qkv.metrics) is scored on all --sentences sentences, decoded once at the last --threads count.

Each engine is timed in a process of its own, alone. PyTorch and CTranslate2 each bring their own
OpenMP runtime (two copies of libgomp): once PyTorch has run one 2-thread operation in a process,
CTranslate2 at intra_threads=2 in that process ran about 4 times slower (1.17 s alone, 4.8 s after one
torch operation), and onnxruntime's threads spin after their work by default. So, at each thread
count, every engine gets a worker process (spawned, not forked) that builds it at that count; a
CTranslate2 or onnxruntime worker runs no torch operation (the parent tokenizes and sends plain lists
of ids). In each repeat the engines take turns engine by engine, the order rotated each repeat: one
worker decodes all the timed batches, timing each batch's decoding itself (perf_counter, summed),
while every other worker waits blocked on its pipe, and 0.2 s pass between two engines so that the
last one's idle threads have stopped spinning. An engine's time is the median over repeats. Two
batches are decoded untimed first (warm-up); the BLEU pass runs in the workers too.

Writes benchmarks/results/deploy/decoding_engines.json: per thread count and engine sentences/s,
target tokens/s (the tokens the engine itself produced, EOS excluded) and its time over CTranslate2
float32's with the same search (greedy or beam); per engine BLEU and how many translations equal qkv's.
With --before GIT_REF, qkv's decoding as it was at that commit is timed too (qkv_greedy_before,
qkv_beam_before): the speed-up of the changes since, measured side by side, and whether the
translations stayed the same.

    python benchmarks/decoding_engines.py --run /work/runs/en-de
    python benchmarks/decoding_engines.py --run /work/runs/en-de --before 3f4fd5a   # + qkv before the changes
    python benchmarks/decoding_engines.py --run RUN --quick --out /tmp/x.json   # a smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any, NamedTuple

import torch

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.cli.evaluate import target_language
from qkv.data.batching import pad_sequences
from qkv.data.sources import load_split
from qkv.decoding.search import beam_search as qkv_beam_search
from qkv.decoding.search import greedy_decode as qkv_greedy_decode
from qkv.metrics.scores import score_translations
from qkv.runs.folder import load_run
from qkv.runtime.machine import environment

OUT = Path(__file__).resolve().parent / "results" / "deploy" / "decoding_engines.json"
EXTRA_LEN = 50  # qkv's length limit: source length + 50 (the exports' too)
PAUSE_S = 0.2  # between two engines' passes: the last one's idle threads stop spinning
TIMING = (
    "each engine in a process of its own (spawned, built at the thread count), timed alone: "
    f"engines in turn, order rotated each repeat, {PAUSE_S} s apart; the worker sums its batches' decoding times"
)
Decoder = Callable[[list[list[int]]], list[list[int]]]  # one batch of source ids -> ids per sentence
Batches = list[list[list[int]]]  # batches of sentences' source ids, as the workers get them
logger = logging.getLogger("decoding_engines")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a translation run folder (read only)")
    add_result_options(p, OUT)
    p.add_argument("--exports", default=None, help="reuse (or write) the exports here instead of a new /tmp folder")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch-size", type=int, default=16, help="sentences per batch")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--alpha", type=float, default=None, help="length penalty exponent (default: the run's)")
    p.add_argument("--sentences", type=int, default=None, help="sentences decoded for BLEU (default: all)")
    p.add_argument("--timed-sentences", type=int, default=240, help="sentences timed at each thread count")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (the median counts)")
    p.add_argument("--with-gnmt", action="store_true", help="also time qkv's beam search with its GNMT penalty")
    p.add_argument(
        "--before",
        default=None,
        metavar="GIT_REF",
        help="also time qkv's decoding as it was at this commit (src/qkv/decoding/ from git): "
        "qkv_greedy_before, qkv_beam_before",
    )
    p.add_argument("--engines", nargs="+", default=None, help="only these engines (names as in the docstring)")
    p.add_argument("--quick", action="store_true", help="24 sentences, 16 timed, 1 repeat, 1 thread: a smoke test")
    args = p.parse_args(argv)
    args.out = check_result_file(p, args)
    if args.quick:
        args.sentences, args.timed_sentences, args.repeats, args.threads = 24, 16, 1, [1]
    return args


def export_all(run: str, folder: Path) -> dict[str, Path | str]:
    """The run's four exports in ``folder`` (an export already there is reused); per export its folder,
    or why it could not be made (a configuration the format cannot hold)."""
    from qkv.export.ctranslate2 import export_ctranslate2
    from qkv.export.huggingface import export_hf
    from qkv.export.onnx import export_onnx

    makers: dict[str, Callable[[Path], Any]] = {
        "hf": lambda out: export_hf(run, out),
        "onnx": lambda out: export_onnx(run, out),
        "ct2_float32": lambda out: export_ctranslate2(run, out),
        "ct2_int8": lambda out: export_ctranslate2(run, out, quantization="int8"),
    }
    found: dict[str, Path | str] = {}
    for name, make in makers.items():
        out = folder / name
        if out.is_dir() and any(out.iterdir()):
            found[name] = out
            continue
        start = time.perf_counter()
        try:
            make(out)
        except (ValueError, ImportError) as err:
            found[name] = f"not exported: {err}"
            logger.warning("%s %s", name, found[name])
            continue
        found[name] = out
        logger.info("exported %s in %.1f s", name, time.perf_counter() - start)
    return found


def sorted_batches(ids: list[list[int]], size: int) -> list[list[int]]:
    """Indices of ``ids`` sorted by length (stable), in batches of ``size``."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    return [order[i : i + size] for i in range(0, len(order), size)]


def timed_subset(batches: list[list[int]], sentences: int) -> list[list[int]]:
    """About ``sentences`` sentences' worth of ``batches``, evenly spread over all of them (short to long)."""
    want = max(1, min(len(batches), -(-sentences // max(1, len(batches[0]))) if batches else 0))
    step = len(batches) / want
    return [batches[int(i * step)] for i in range(want)]


_SEARCH_AT: dict[str, ModuleType] = {}  # ref -> its search module, loaded once a process


def search_at(ref: str) -> ModuleType:
    """``qkv.decoding.search`` as it was at git commit ``ref``, with the rest of ``qkv.decoding`` as it was
    then too (the steps and the packed products: a change to any of them is timed), loaded as a separate
    package beside today's; the model and the layers below are today's."""
    if ref in _SEARCH_AT:
        return _SEARCH_AT[ref]
    root = Path(__file__).resolve().parent.parent
    package = "qkv_decoding_before"
    folder = Path(tempfile.mkdtemp(prefix="qkv-decoding-")) / package
    folder.mkdir()
    names = subprocess.run(
        ["git", "-C", str(root), "ls-tree", "--name-only", ref, "src/qkv/decoding/"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in names:
        if not name.endswith(".py"):
            continue
        text = subprocess.run(
            ["git", "-C", str(root), "show", f"{ref}:{name}"], capture_output=True, text=True, check=True
        ).stdout
        (folder / Path(name).name).write_text(text.replace("qkv.decoding.", f"{package}."))
    (folder / "__init__.py").write_text("")  # not the package's own: it would import today's names
    for entry in [e for e in sys.path if Path(e).name.startswith("qkv-decoding-")]:
        sys.path.remove(entry)  # another ref's folder: one on the path at a time
    sys.path.insert(0, str(folder.parent))
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        del sys.modules[name]  # another ref's modules (those already loaded keep working)
    _SEARCH_AT[ref] = importlib.import_module(f"{package}.search")
    return _SEARCH_AT[ref]


def qkv_engines(
    model: Any, tok: Any, beam: int, alpha: float, with_gnmt: bool, search: Any = None, suffix: str = ""
) -> dict[str, Decoder]:
    """qkv's greedy decoding and beam search (``search``: the module that has them, default today's)."""
    pad, bos, eos = model.config.pad_id, tok.bos_id, tok.eos_id
    greedy_decode = search.greedy_decode if search is not None else qkv_greedy_decode
    beam_search = search.beam_search if search is not None else qkv_beam_search

    def greedy(batch: list[list[int]]) -> list[list[int]]:
        return greedy_decode(model, pad_sequences(batch, pad), bos_id=bos, eos_id=eos, extra_len=EXTRA_LEN)

    def beam_with(penalty: str) -> Decoder:
        def decode(batch: list[list[int]]) -> list[list[int]]:
            src = pad_sequences(batch, pad)
            kw = dict(bos_id=bos, eos_id=eos, beam_size=beam, alpha=alpha, extra_len=EXTRA_LEN)
            return beam_search(model, src, penalty=penalty, **kw)  # type: ignore[arg-type]

        return decode

    engines = {f"qkv_greedy{suffix}": greedy, f"qkv_beam{suffix}": beam_with("power")}
    if with_gnmt:
        engines[f"qkv_beam_gnmt{suffix}"] = beam_with("gnmt")
    return engines


def batch_limit(batch: list[list[int]], max_len: int) -> int:
    """qkv's length limit for the longest sentence of ``batch``: its length + 50, capped by the table."""
    return min(max(len(s) for s in batch) + EXTRA_LEN, max_len - 1)


def hf_engines(folder: Path, beam: int, alpha: float, pad: int, eos: int, max_len: int) -> dict[str, Decoder]:
    import transformers
    from transformers import MarianMTModel

    transformers.logging.set_verbosity_error()  # not a warning per batch that max_new_tokens wins over max_length

    hf = MarianMTModel.from_pretrained(str(folder)).eval()

    def with_beams(n: int) -> Decoder:
        def decode(batch: list[list[int]]) -> list[list[int]]:
            src = pad_sequences(batch, pad)
            extra = dict(num_beams=n, length_penalty=alpha, early_stopping=True) if n > 1 else dict(num_beams=1)
            with torch.inference_mode():
                out = hf.generate(
                    input_ids=src,
                    attention_mask=src != pad,
                    do_sample=False,
                    max_new_tokens=batch_limit(batch, max_len),
                    **extra,
                )
            return [_until_eos(row[1:], eos, pad) for row in out.tolist()]  # row[0]: the decoder start (BOS)

        return decode

    return {"hf_greedy": with_beams(1), "hf_beam": with_beams(beam)}


def _until_eos(ids: list[int], eos: int, pad: int) -> list[int]:
    ids = ids[: ids.index(eos)] if eos in ids else ids
    return [i for i in ids if i != pad]


def ct2_engines(exports: dict[str, Path | str], threads: int, beam: int, alpha: float) -> dict[str, Decoder]:
    from qkv.export.ctranslate2 import Ct2Translator

    engines: dict[str, Decoder] = {}
    for kind in ("float32", "int8"):
        folder = exports.get(f"ct2_{kind}")
        if not isinstance(folder, Path):
            continue
        ct2 = Ct2Translator(folder, threads=threads, compute_type=kind)

        def with_beams(n: int, ct2: Ct2Translator = ct2) -> Decoder:
            def decode(batch: list[list[int]]) -> list[list[int]]:
                outputs = ct2.translator.translate_batch(
                    [ct2.to_tokens(s) for s in batch],
                    beam_size=n,
                    length_penalty=alpha if n > 1 else 0.0,
                    max_decoding_length=batch_limit(batch, ct2.manifest["max_len"]),
                    max_input_length=0,
                )
                return [[ct2.ids[t] for t in o.hypotheses[0]] for o in outputs]

            return decode

        engines[f"ct2_{kind}_greedy"], engines[f"ct2_{kind}_beam"] = with_beams(1), with_beams(beam)
    return engines


def ort_engines(exports: dict[str, Path | str], threads: int) -> dict[str, Decoder]:
    from qkv.export.onnx_runtime import OnnxTranslator, pad_batch

    folder = exports.get("onnx")
    if not isinstance(folder, Path):
        return {}
    ort = OnnxTranslator(folder, threads=threads)
    return {"onnxruntime_greedy": lambda batch: ort.greedy(pad_batch(batch, ort.pad_id))}


def decode_all(decode: Decoder, ids: list[list[int]], batches: list[list[int]]) -> dict[int, list[int]]:
    """``decode`` over ``batches`` (indices into ``ids``): sentence index -> its output ids."""
    out: dict[int, list[int]] = {}
    for batch in batches:
        for i, result in zip(batch, decode([ids[i] for i in batch]), strict=True):
            out[i] = result
    return out


# --------------------------------------------------------------------------- engines in worker processes


class EngineFailed(RuntimeError):
    """An engine's worker raised (building or decoding) or died; the message names the engine, on one line."""


class EngineSpec(NamedTuple):
    """How a worker process builds the engine ``name``: ``build(threads, **kwargs)`` returns engines by name
    (as :func:`qkv_engines` etc. do), ``name`` among them. ``build`` must be a module-level function of a
    module the worker can import by name (this one, or one on ``sys.path``: a spawned process imports it
    anew), and ``kwargs`` plain values (paths, numbers, strings, lists)."""

    name: str
    build: Callable[..., dict[str, Decoder]]
    kwargs: Mapping[str, Any] = MappingProxyType({})


HOME = "decoding_engines"  # this module's name where a worker imports it


def _home() -> ModuleType:
    """This module as a spawned worker imports it (by name, from the benchmarks folder): the parent hands
    the workers functions of that module, since a copy loaded from the file under another name, or run as
    ``__main__``, cannot be pickled by reference."""
    folder = str(Path(__file__).resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # a spawned process starts with the parent's sys.path
    return importlib.import_module(HOME)


def _reference(build: Callable[..., Any]) -> str:
    """``module:function`` for a module-level function, the module named as a worker imports it."""
    qualname = getattr(build, "__qualname__", "")
    if not qualname or "<" in qualname or "." in qualname:
        raise ValueError(f"{build!r}: an engine builder must be a module-level function (a worker imports it)")
    module = HOME if build.__module__ in (__name__, "__main__", HOME) else build.__module__
    return f"{module}:{qualname}"


def _one_line(err: BaseException) -> str:
    """``Type: message (file:line in function)``, on one line: where in the worker it was raised."""
    text = str(err).strip().splitlines()
    where = traceback.extract_tb(err.__traceback__)[-1:] if err.__traceback__ else []
    at = f" ({Path(where[0].filename).name}:{where[0].lineno} in {where[0].name})" if where else ""
    return f"{type(err).__name__}: {text[0] if text else ''}{at}"


def _worker(conn: Connection, name: str, build: str, kwargs: dict[str, Any], threads: int) -> None:
    """A worker process: builds engine ``name`` at ``threads`` threads, says ("ready", pid), then decodes
    the batches of each ("run", batches) it gets, timing each batch's decoding (perf_counter) and answering
    ("done", {seconds, outputs, pid, start, end}) (start, end: wall clock, time.time()), until ("stop", None)
    or the parent is gone. An error is answered ("error", one line) and ends the worker. Between two
    commands the worker is blocked reading its pipe: idle."""
    try:
        module, function = build.split(":")
        engines = getattr(importlib.import_module(module), function)(threads, **kwargs)
        if name not in engines:
            raise LookupError(f"{build} made no engine {name!r} (it made {', '.join(engines) or 'none'})")
        decode = engines[name]
        conn.send(("ready", os.getpid()))
        while True:
            try:
                command, batches = conn.recv()
            except EOFError:
                return  # the parent is gone
            if command == "stop":
                return
            outputs, seconds = [], 0.0
            start_wall = time.time()
            for batch in batches:
                start = time.perf_counter()
                out = decode(batch)
                seconds += time.perf_counter() - start
                outputs.append(out)
            end_wall = time.time()
            outputs = [[[int(t) for t in sentence] for sentence in out] for out in outputs]
            conn.send(("done", dict(seconds=seconds, outputs=outputs, pid=os.getpid(), start=start_wall, end=end_wall)))
    except KeyboardInterrupt:
        return  # Ctrl-C reaches the workers too: the parent reports it
    except Exception as err:  # sent back: the parent fails naming the engine
        with contextlib.suppress(OSError):
            conn.send(("error", _one_line(err)))
    finally:
        conn.close()


class EngineWorkers:
    """One spawned worker process per engine of ``specs``, each building its engine at ``threads`` threads.
    A context manager: on entry every worker is started and has built its engine; on exit (or a failure)
    every worker is stopped, terminated if it does not stop. :meth:`run` has one engine decode while the
    other workers wait."""

    def __init__(self, specs: Sequence[EngineSpec], threads: int) -> None:
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names repeat: {names}")
        self.specs, self.threads = list(specs), threads
        self.processes: dict[str, BaseProcess] = {}
        self.pids: dict[str, int] = {}
        self._conns: dict[str, Connection] = {}

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    def __enter__(self) -> EngineWorkers:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Starts every worker, then waits until each has built its engine."""
        context = multiprocessing.get_context("spawn")
        target = _home()._worker
        for spec in self.specs:
            ours, theirs = context.Pipe()
            args = (theirs, spec.name, _reference(spec.build), dict(spec.kwargs), self.threads)
            process = context.Process(target=target, args=args, name=f"engine {spec.name}", daemon=True)
            self._conns[spec.name] = ours
            self.processes[spec.name] = process
            process.start()
            theirs.close()  # the worker's end: closed here, so that its death reads as the end of the pipe
        for name in self.names:
            self.pids[name] = self._receive(name, "building")

    def run(self, name: str, batches: Batches) -> dict[str, Any]:
        """Engine ``name`` decodes ``batches`` (each a list of sentences' ids): its summed decoding time
        ``seconds``, ``outputs`` (per batch the ids per sentence), its ``pid`` and the wall-clock ``start``
        and ``end`` of the pass."""
        with contextlib.suppress(OSError):  # the worker is gone: _receive says how
            self._conns[name].send(("run", batches))
        return self._receive(name, "decoding")

    def _receive(self, name: str, doing: str) -> Any:
        conn, process = self._conns[name], self.processes[name]
        message = None
        if conn in multiprocessing.connection.wait([conn, process.sentinel]):
            with contextlib.suppress(EOFError):  # the worker is gone
                message = conn.recv()
        if message is None:
            process.join(5)
            raise EngineFailed(f"engine {name}: its worker ended while {doing} (exit code {process.exitcode})")
        kind, payload = message
        if kind == "error":
            raise EngineFailed(f"engine {name} failed in its worker while {doing}: {payload}")
        return payload

    def close(self) -> None:
        """Stops every worker: asks, then terminates, then kills those still running."""
        for conn in self._conns.values():
            with contextlib.suppress(OSError):
                conn.send(("stop", None))
        deadline = time.monotonic() + 10
        for process in self.processes.values():
            if process.pid is None:
                continue  # never started
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join(5)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self._conns.values():
            conn.close()


def _qkv_at(threads: int, run: str, beam: int, alpha: float, with_gnmt: bool, before: str | None) -> dict[str, Decoder]:
    """A worker's qkv engines: the run loaded here, torch at ``threads`` threads; ``before``: qkv's decoding
    as it was at that git ref (the engines named ``..._before``)."""
    model, tok, _ = load_run(run, "model", task="translation")
    model.eval()
    torch.set_num_threads(threads)
    search = search_at(before) if before else None
    return qkv_engines(model, tok, beam, alpha, with_gnmt, search, "_before" if before else "")


def _hf_at(threads: int, folder: Path, beam: int, alpha: float, pad: int, eos: int, max_len: int) -> dict[str, Decoder]:
    """A worker's Hugging Face engines, torch at ``threads`` threads."""
    torch.set_num_threads(threads)
    return hf_engines(folder, beam, alpha, pad, eos, max_len)


def _ct2_at(threads: int, kind: str, folder: Path, beam: int, alpha: float) -> dict[str, Decoder]:
    """A worker's CTranslate2 engines of one compute type (no torch operation runs in this process)."""
    return ct2_engines({f"ct2_{kind}": folder}, threads, beam, alpha)


def _ort_at(threads: int, folder: Path) -> dict[str, Decoder]:
    """A worker's onnxruntime engine (no torch operation runs in this process)."""
    return ort_engines({"onnx": folder}, threads)


def engine_specs(
    args: argparse.Namespace, exports: dict[str, Path | str], alpha: float, pad: int, eos: int, max_len: int
) -> list[EngineSpec]:
    """Every engine (those of --engines only, where given), each to be built in a worker of its own."""
    specs: list[EngineSpec] = []
    searches = ["greedy", "beam"] + (["beam_gnmt"] if args.with_gnmt else [])
    qkv = dict(run=str(args.run), beam=args.beam, alpha=alpha, with_gnmt=args.with_gnmt)
    for before, suffix in [(None, "")] + ([(args.before, "_before")] if args.before else []):
        specs += [EngineSpec(f"qkv_{s}{suffix}", _qkv_at, dict(qkv, before=before)) for s in searches]
    hf = exports.get("hf")
    if isinstance(hf, Path):
        kw = dict(folder=hf, beam=args.beam, alpha=alpha, pad=pad, eos=eos, max_len=max_len)
        specs += [EngineSpec(f"hf_{s}", _hf_at, kw) for s in ("greedy", "beam")]
    for kind in ("float32", "int8"):
        folder = exports.get(f"ct2_{kind}")
        if isinstance(folder, Path):
            kw = dict(kind=kind, folder=folder, beam=args.beam, alpha=alpha)
            specs += [EngineSpec(f"ct2_{kind}_{s}", _ct2_at, kw) for s in ("greedy", "beam")]
    onnx = exports.get("onnx")
    if isinstance(onnx, Path):
        specs.append(EngineSpec("onnxruntime_greedy", _ort_at, dict(folder=onnx)))
    if args.engines:
        specs = [s for s in specs if s.name in args.engines]
    return specs


def batch_ids(ids: list[list[int]], batches: list[list[int]]) -> Batches:
    """``batches`` of indices into ``ids`` as the sentences' ids themselves (what a worker gets)."""
    return [[ids[i] for i in batch] for batch in batches]


def by_sentence(batches: list[list[int]], outputs: Batches) -> dict[int, list[int]]:
    """A worker's ``outputs`` (per batch, per sentence) by sentence index."""
    return {i: out for batch, outs in zip(batches, outputs, strict=True) for i, out in zip(batch, outs, strict=True)}


def timed_passes(
    workers: EngineWorkers, batches: Batches, repeats: int, pause: float = PAUSE_S
) -> dict[str, list[dict[str, Any]]]:
    """Every engine over ``batches``: one untimed pass over two batches (warm-up), then ``repeats`` timed
    passes. The engines take turns engine by engine (the order rotated every repeat), ``pause`` seconds
    apart: one decodes while the others wait blocked. Per engine its passes (:meth:`EngineWorkers.run`)."""
    names = workers.names
    if not names:
        return {}
    for name in names:
        time.sleep(pause)
        workers.run(name, batches[:2])
    passes: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(repeats):
        turn = r % len(names)
        for name in names[turn:] + names[:turn]:
            time.sleep(pause)
            passes[name].append(workers.run(name, batches))
        logger.info("repeat %d/%d: %s", r + 1, repeats, {n: round(p[-1]["seconds"], 2) for n, p in passes.items()})
    return passes


def time_engines(
    workers: EngineWorkers, ids: list[list[int]], batches: list[list[int]], repeats: int, pause: float = PAUSE_S
) -> dict[str, dict[str, Any]]:
    """Every engine of ``workers`` over ``batches`` (indices into ``ids``), each alone in its process
    (:func:`timed_passes`). Returns per engine its times, median, sentences/s and tokens/s, its time over
    CTranslate2 float32's with the same search and, beside an engine ``..._before``, the speed-up over it."""
    passes = timed_passes(workers, batch_ids(ids, batches), repeats, pause)
    sentences = sum(len(b) for b in batches)
    results, outputs = {}, {}
    for name, runs in passes.items():
        times = [p["seconds"] for p in runs]
        outputs[name] = by_sentence(batches, runs[-1]["outputs"])
        median = statistics.median(times)
        tokens = sum(len(o) for o in outputs[name].values())
        results[name] = dict(
            median_s=round(median, 4),
            times_s=[round(t, 4) for t in times],
            sentences=sentences,
            target_tokens=tokens,
            sentences_per_s=round(sentences / median, 2),
            tokens_per_s=round(tokens / median, 1),
        )
    for name, r in results.items():  # the time over CTranslate2 float32's with the same search
        base = results.get("ct2_float32_greedy" if "greedy" in name else "ct2_float32_beam")
        r["time_over_ct2_float32"] = round(r["median_s"] / base["median_s"], 3) if base else None
        before = results.get(f"{name}_before")
        if before:  # the same search as qkv decoded at --before
            r["speedup_over_before"] = round(before["median_s"] / r["median_s"], 3)
            r["same_output_as_before"] = outputs[name] == outputs[f"{name}_before"]
    return results


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    model, tok, config = load_run(args.run, "model", task="translation")
    model.eval()
    alpha = config.get("decode", {}).get("alpha", 0.6) if args.alpha is None else args.alpha
    split = load_split(config.get("data") or {}, "test")
    src, refs = split.src[: args.sentences], split.tgt[: args.sentences]
    limit = model.config.max_len - 1
    ids = [s[:limit] + [tok.eos_id] for s in tok.encode_batch(src)]  # as translate_texts cuts them
    batches = sorted_batches(ids, args.batch_size)
    timed = timed_subset(batches, args.timed_sentences)
    folder = Path(args.exports) if args.exports else Path(tempfile.mkdtemp(prefix="qkv-decoding-engines-"))
    exports = export_all(args.run, folder)
    report: dict[str, Any] = dict(
        run=str(Path(args.run).resolve()),
        exports={n: str(e) for n, e in exports.items()},
        data=dict(split="test", name="test2016" if (config.get("data") or {}).get("source") == "multi30k" else "test"),
        settings=dict(
            batching=f"length-sorted batches of {args.batch_size} sentences, the same for every engine",
            length_limit="longest source of the batch + 50 tokens, capped by the positional table",
            beam=args.beam,
            alpha=alpha,
            qkv_beam_penalty="power (len ** alpha, as Hugging Face and CTranslate2)",
            timing=TIMING,
            repeats=args.repeats,
            sentences_bleu=len(ids),
            sentences_timed=sum(len(b) for b in timed),
        ),
        model=dict(
            parameters=sum(p.numel() for p in model.parameters()),
            **{k: getattr(model.config, k) for k in ("d_model", "num_heads", "d_ff", "tgt_vocab_size")},
            layers=[model.config.num_encoder_layers, model.config.num_decoder_layers],
        ),
        threads={},
    )
    specs = engine_specs(args, exports, alpha, model.config.pad_id, tok.eos_id, model.config.max_len)
    try:
        for threads in args.threads:
            logger.info("%d thread(s): starting a worker per engine: %s", threads, ", ".join(s.name for s in specs))
            with EngineWorkers(specs, threads) as workers:
                report["threads"][str(threads)] = time_engines(workers, ids, timed, args.repeats)
                if threads == args.threads[-1]:
                    report["engines"] = quality(workers, ids, batches, src, refs, tok, config)
    except EngineFailed as err:
        print(f"decoding_engines: {err}", file=sys.stderr)
        return 1
    report["headline"] = headline(report)
    report["machine"] = environment()
    write_result(args.out, report, ["benchmarks/decoding_engines.py", *(sys.argv[1:] if argv is None else argv)])
    print_table(report)
    return 0


def quality(
    workers: EngineWorkers,
    ids: list[list[int]],
    batches: list[list[int]],
    src: list[str],
    refs: list[str],
    tok: Any,
    config: dict,
    pause: float = PAUSE_S,
) -> dict[str, dict[str, Any]]:
    """Every engine over all sentences, each in its worker (at the workers' thread count, engines in
    turn): BLEU, and the share of translations equal to qkv's with the same search."""
    lang = target_language(config.get("data") or {}, None)
    texts: dict[str, list[str]] = {}
    out: dict[str, dict[str, Any]] = {}
    sentences = batch_ids(ids, batches)
    for name in workers.names:
        if name.endswith("_before"):  # the same translations as today's (time_engines compares them)
            continue
        time.sleep(pause)
        result = workers.run(name, sentences)
        decoded, seconds = by_sentence(batches, result["outputs"]), result["seconds"]
        texts[name] = [tok.decode(decoded[i]) for i in range(len(ids))]
        scores = score_translations(texts[name], refs, target_lang=lang)
        out[name] = dict(bleu=round(scores["bleu"], 2), chrf=round(scores["chrf"], 2), full_pass_s=round(seconds, 2))
        logger.info("%s: BLEU %.2f (%.1f s)", name, scores["bleu"], seconds)
    for name, r in out.items():
        same = "qkv_greedy" if "greedy" in name else "qkv_beam"
        if same in texts:
            r[f"equal_to_{same}"] = round(sum(a == b for a, b in zip(texts[name], texts[same])) / len(src), 4)
    return out


def headline(report: dict) -> dict[str, float]:
    """The figures benchmarks/results/INDEX.md lists: qkv's time over CTranslate2 float32's per search and
    thread count, and the BLEUs of qkv and CTranslate2 float32."""
    out = {}
    for threads, engines in report["threads"].items():
        for search in ("greedy", "beam"):
            ratio = engines.get(f"qkv_{search}", {}).get("time_over_ct2_float32")
            if ratio is not None:
                out[f"qkv_{search}_time_over_ct2_float32_{threads}_thread"] = ratio
    for name in ("qkv_greedy", "qkv_beam", "ct2_float32_beam"):
        if name in report["engines"]:
            out[f"{name}_bleu"] = report["engines"][name]["bleu"]
    return out


def print_table(report: dict) -> None:
    for threads, engines in report["threads"].items():
        print(f"{threads} thread(s): engine, sentences/s, tokens/s, time over CTranslate2 float32, BLEU")
        for name, r in engines.items():
            bleu = report["engines"].get(name, {}).get("bleu")
            print(
                f"  {name:22s} {r['sentences_per_s']:8.1f} {r['tokens_per_s']:9.1f} {r['time_over_ct2_float32']}  {bleu}"
            )


if __name__ == "__main__":
    sys.exit(main())
