"""``qkv serve --workers N``: N server processes sharing one listening socket, under uvicorn's supervisor.

The parent binds the socket, writes the options for its workers to a file of its own (a folder only
its user may read: an API key given on the command line is among them), and starts the workers with
uvicorn's multiprocess supervisor (:class:`uvicorn.supervisors.Multiprocess`; ``spawn``: each worker
is a fresh interpreter). Each worker opens its own copy of the models (memory times N), with
``--threads`` (default: the cores divided by N) for torch and CTranslate2, and serves the shared
socket exactly as one ``qkv serve`` process does (the builder it is given, ``qkv serve``'s own,
within :func:`qkv.serve.server.serving_on`); the kernel hands each new connection to one of them.

Each worker reports to the parent once, in a file of the same folder: its models, or the one-line
error it failed with. The parent prints the one startup line when every worker serves; when one
fails to start, it stops the others and raises that error (the command fails with it rather than
retrying forever). A worker that dies later is replaced. On SIGTERM or Ctrl-C the parent closes its
copy of the socket, asks every worker to stop (SIGTERM: each drains, as one process does) and waits
for them, at most the drain timeout and :data:`JOIN_GRACE_S` more, then kills what is left.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors.multiprocess import Multiprocess, Process

from qkv.runtime.fileio import read_json
from qkv.runtime.heap import limit_memory_growth
from qkv.serve.errors import one_line
from qkv.serve.server import LISTEN_BACKLOG, Server, bind_socket, serving_on

logger = logging.getLogger(__name__)

Listing = dict[str, dict[str, str]]  # each model's endpoint and engine, by name
Builder = Callable[[argparse.Namespace], tuple[Server, Listing]]
JOIN_GRACE_S = 10.0  # past the drain timeout, what a worker has to exit before it is killed
POLL_S = 0.1
# a worker's failure that means its input was wrong (a model folder, an option): exit 2, as one process
INPUT_ERRORS = (ValueError, OSError)


def worker_threads(threads: int | None, workers: int) -> int:
    """The CPU threads each of ``workers`` processes uses: ``threads`` when given, else this process's
    cores divided among them (at least one)."""
    if threads is not None:
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // workers)


class WorkerProcess(Process):
    """One worker of :class:`WorkerSupervisor`: uvicorn's worker process (its health-check pipe, its
    start), whose target, in the new process, builds the server with ``build`` on the shared socket,
    reports to the parent, and serves.

    Args:
        config: the supervisor's uvicorn config (the worker count, the health-check timeout).
        sockets: the shared listening socket (one).
        build: ``qkv serve``'s builder: the options -> the server (not yet serving) and its models.
        folder: the parent's folder, holding ``options.json``; the worker writes its report there.
    """

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket], build: Builder, folder: str) -> None:
        self.build, self.folder = build, folder
        super().__init__(config, sockets)

    def target(self, sockets: list[socket.socket] | None = None) -> None:  # pragma: no cover - a child process
        """In the worker: answer the parent's health checks, build the server on ``sockets[0]``
        (exit with :data:`~uvicorn.config.STARTUP_FAILURE` and a report of the error when that fails),
        report the models, then serve until SIGTERM (a drain, as in one process)."""
        threading.Thread(target=self.always_pong, daemon=True).start()
        options = argparse.Namespace(**read_json(Path(self.folder) / "options.json"))
        # what the qkv command sets up before any subcommand, as in one process
        logging.basicConfig(
            level=logging.DEBUG if getattr(options, "verbose", False) else logging.INFO, format="%(message)s"
        )
        limit_memory_growth()
        assert sockets, "a worker serves its parent's socket"
        try:
            with serving_on(sockets[0]):
                server, listing = self.build(options)
        except Exception as err:  # noqa: BLE001 - reported to the parent, which fails with it
            write_report(self.folder, {"error": one_line(err, 500), "input": isinstance(err, INPUT_ERRORS)})
            sys.exit(STARTUP_FAILURE)
        self._server = server.uvicorn  # what the health checks report: started, once it serves
        write_report(self.folder, {"models": listing})
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C reached the worker too: it has drained
            server.serve_forever()


def write_report(folder: str, report: dict[str, Any]) -> None:
    """Write this worker's report (``worker-PID.json``) whole: the parent never reads half of one."""
    path = Path(folder) / f"worker-{os.getpid()}.json"
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps(report))
    partial.replace(path)


def read_report(folder: str, pid: int | None) -> dict[str, Any] | None:
    """Worker ``pid``'s report, or None before it has written one."""
    path = Path(folder) / f"worker-{pid}.json"
    return read_json(path) if pid is not None and path.is_file() else None


class WorkerFailed(Exception):
    """A worker could not start (its error, in one line); ``input``: the error was the input's."""

    def __init__(self, message: str, *, input_error: bool) -> None:
        super().__init__(message)
        self.input_error = input_error


class WorkerSupervisor(Multiprocess):
    """uvicorn's multiprocess supervisor for ``qkv serve``'s workers (:class:`WorkerProcess`): it
    waits for every worker to serve (or fails with the first one's error), replaces a worker that dies
    later, and stops them all on SIGTERM or Ctrl-C, bounded by ``drain_timeout_s``.

    Args:
        config: the uvicorn config (``workers``: how many).
        sockets: the listening socket they share.
        build: ``qkv serve``'s builder (see :class:`WorkerProcess`).
        folder: the parent's folder of options and reports.
        drain_timeout_s: each worker's drain timeout.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        sockets: list[socket.socket],
        *,
        build: Builder,
        folder: str,
        drain_timeout_s: float,
    ) -> None:
        super().__init__(config, sockets)  # also takes over the signals: they are queued for the loop
        self.build, self.folder, self.drain_timeout_s = build, folder, drain_timeout_s

    def new_process(self) -> WorkerProcess:
        """A worker, started."""
        process = WorkerProcess(self.config, self.sockets, self.build, self.folder)
        process.start()
        return process

    def init_processes(self) -> None:
        """Start the workers."""
        self.processes = [self.new_process() for _ in range(self.processes_num)]

    def serve(self, on_ready: Callable[[Listing], None]) -> None:
        """Start the workers, call ``on_ready`` with their models once all serve, then supervise them
        until SIGTERM or Ctrl-C; the workers are stopped on the way out, whatever ends this.

        Raises:
            WorkerFailed: a worker could not start.
        """
        try:
            self.init_processes()
            listing = self.wait_until_serving()
            if listing is None:  # told to stop before every worker served
                return
            on_ready(listing)
            while not self.should_exit.wait(0.5):
                self.handle_signals()
                self.keep_subprocess_alive()
        finally:
            self.stop()

    def wait_until_serving(self) -> Listing | None:
        """The first worker's models once every worker serves; None if a signal comes first.

        Raises:
            WorkerFailed: a worker reported an error, or ended before serving.
        """
        while True:
            self.handle_signals()
            if self.should_exit.is_set():
                return None
            reports = [read_report(self.folder, process.pid) for process in self.processes]
            for process, report in zip(self.processes, reports):
                if report is not None and "error" in report:
                    raise WorkerFailed(report["error"], input_error=report["input"])
                if report is None and process.exitcode is not None:
                    raise WorkerFailed(
                        f"a worker process ended (exit code {process.exitcode}) before serving", input_error=False
                    )
            if all(reports) and all(process.is_ready(timeout=1) for process in self.processes):
                return reports[0]["models"]  # type: ignore[index]
            time.sleep(POLL_S)

    def keep_subprocess_alive(self) -> None:
        """Replace a worker that has died (or stopped answering its health checks) with a new one."""
        if self.should_exit.is_set():
            return
        for index, process in enumerate(self.processes):
            if process.is_alive(timeout=self.config.timeout_worker_healthcheck):
                continue
            process.kill()
            process.join()
            if self.should_exit.is_set():
                return
            logger.warning(
                "warning: worker process %s ended (exit code %s); starting another", process.pid, process.exitcode
            )
            self.processes[index] = self.new_process()

    def handle_hup(self) -> None:
        """SIGHUP: ignored (uvicorn restarts its workers; qkv's would open every model again)."""
        logger.info("SIGHUP ignored: stop the server and start it again to reload the models")

    def handle_ttin(self) -> None:
        """SIGTTIN: ignored (the number of workers is --workers)."""
        logger.info("SIGTTIN ignored: the number of workers is --workers")

    def handle_ttou(self) -> None:
        """SIGTTOU: ignored (the number of workers is --workers)."""
        logger.info("SIGTTOU ignored: the number of workers is --workers")

    def stop(self) -> None:
        """Close the parent's copy of the socket (no new connection is queued for the workers), ask
        each worker to stop (SIGTERM: it drains), and wait for them: at most the drain timeout and
        :data:`JOIN_GRACE_S`, then kill what is left."""
        for sock in self.sockets:
            sock.close()
        self.terminate_all()
        deadline = time.monotonic() + self.drain_timeout_s + JOIN_GRACE_S
        for process in self.processes:
            process.process.join(max(0.0, deadline - time.monotonic()))
            if process.process.is_alive():
                logger.warning("warning: worker process %s did not stop in time; killed", process.pid)
                process.kill()
                process.process.join()


def serve_workers(
    args: argparse.Namespace, build: Builder, on_ready: Callable[[tuple[str, int], Listing], None]
) -> int:
    """Run ``qkv serve --workers N`` (the parent; see the module).

    Args:
        args: the checked options (``workers`` > 1).
        build: the builder each worker runs (``qkv serve``'s ``open_server``).
        on_ready: called once every worker serves, with the address and the models (``qkv serve``
            prints its startup line).

    Returns:
        0 once the workers have stopped (SIGTERM or Ctrl-C).

    Raises:
        ValueError: the address cannot be bound, or a worker failed on its input (a model folder, an
            option): its one-line error. RuntimeError: a worker failed otherwise.
    """
    try:
        sock = bind_socket(args.host, args.port, LISTEN_BACKLOG)
    except OSError as err:  # the port is taken, the address is not this machine's, ...
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {err.strerror or err}") from None
    sock.set_inheritable(True)
    address = sock.getsockname()[:2]
    # the supervisor's config: how many workers and their health checks; each worker builds its own server
    # (the app is the builder, named here, never loaded by uvicorn)
    config = uvicorn.Config(build, workers=args.workers, log_level="warning")
    with tempfile.TemporaryDirectory(prefix="qkv-serve-") as folder:  # only this user may read it
        options = {**vars(args), "threads": worker_threads(args.threads, args.workers), "port": address[1]}
        (Path(folder) / "options.json").write_text(json.dumps(options))
        supervisor = WorkerSupervisor(config, [sock], build=build, folder=folder, drain_timeout_s=args.drain_timeout)
        try:
            supervisor.serve(lambda listing: on_ready(address, listing))
        except WorkerFailed as err:
            raise (ValueError if err.input_error else RuntimeError)(str(err)) from None
        finally:
            sock.close()
    return 0
