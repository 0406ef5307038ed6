"""``qkv serve``: qkv models behind an HTTP API (FastAPI + uvicorn), with the attention explorer.

qkv serve                                       # all-MiniLM-L6-v2 (/v1/embed) on http://127.0.0.1:8000/
qkv serve --model runs/en-de                    # /v1/translate, batching concurrent requests
qkv serve --model runs/shakespeare              # /v1/generate, tokens as server-sent events
qkv serve --model runs/en-de --max-batch-wait 0 # no batching: each request decoded alone

Each model's kind decides its endpoint; every model is also in the explorer (GET /). The API is
documented at /docs. See docs/serve.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from qkv.cli.options import MAX_BEAM, beam_size

if TYPE_CHECKING:
    from qkv.serve.server import Server

DEFAULT_TEXT = "time flies like an arrow"
ENGINES = ("qkv", "ctranslate2")  # qkv.serve.models.SERVE_ENGINES (not imported here: the parser stays light)
MAX_WORKERS = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``qkv serve``'s flags: the models (``--model``, repeatable), where to listen
    (``--host``, ``--port``), the request limits, batching, queue, connection and timeout limits,
    ``--allow-host``, the explorer's ``--text`` and ``--threads``; the old ``--timeout`` and
    ``--max-concurrent`` are still accepted, hidden (see :func:`warn_about_old_options`).

    Args:
        parser: the ``serve`` subcommand's parser, to add the flags to.
    """
    parser.add_argument(
        "--model",
        action="append",
        help="a qkv translation or language-model run folder, or a BERT, GPT-2, Llama, Mistral or Qwen2 "
        "checkpoint folder; repeat for "
        "several (default: all-MiniLM-L6-v2). A translation run serves /v1/translate, a language model "
        "/v1/generate, an encoder /v1/embed; all are in the explorer.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    parser.add_argument("--max-chars", type=int, default=500, help="longest accepted text (default 500 characters)")
    parser.add_argument("--max-texts", type=int, default=64, help="texts per translate/embed request (default 64)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=512, help="tokens one generate request may ask for (default 512)"
    )
    parser.add_argument(
        "--max-beam",
        type=beam_size,
        default=16,
        help=f"the largest beam size a translate request may ask for (default 16; at most {MAX_BEAM}, the beam "
        "limit of qkv translate)",
    )
    parser.add_argument(
        "--max-batch-wait",
        type=float,
        default=5.0,
        help="milliseconds a translation request waits for others to share its batch (default 5; 0 = no "
        "batching, each request is decoded alone)",
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=4000,
        help="source tokens times beam size in one decoding batch (default 4000)",
    )
    parser.add_argument(
        "--max-generate-batch",
        type=int,
        default=32,
        help="generation requests of one language model decoded together, each joining and leaving the batch "
        "between steps (continuous batching; default 32; 1 = one at a time)",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=32,
        help="requests one model may hold waiting or running; one more is answered 503 with Retry-After (default 32)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections at most (default: what the open-file limit, ulimit -n, leaves room for); past it "
        "the connection that has waited longest for its client is closed",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection has to send a request's headers (default 10); then 408 and closed",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request has to send its body once its headers are in (default 30)",
    )
    parser.add_argument(
        "--allow-host",
        action="append",
        help="a Host name to answer besides localhost, 127.0.0.1 and [::1] (repeat for several; '*': any); "
        "other names get 421, which stops a web page from reaching the server through DNS rebinding",
    )
    parser.add_argument(
        "--text",
        help=f"the sentence shown when the explorer opens (default {DEFAULT_TEXT!r}, or for a character-level "
        "language model whose vocabulary lacks its characters, the start of the run's own text)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for the models (default: all cores; with --workers N, the cores divided by N in each)",
    )
    add_process_arguments(parser)
    add_operations_arguments(parser)
    # 1.0's limits of the hand-written server: still accepted, so scripts keep working, and ignored with a warning
    for gone in ("--timeout", "--max-concurrent"):
        parser.add_argument(gone, type=float, default=None, help=argparse.SUPPRESS)


def add_process_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare what decodes and how the server runs: ``--engine``, ``--workers`` and ``--drain-timeout``.

    Args:
        parser: the ``serve`` subcommand's parser, to add the group to.
    """
    group = parser.add_argument_group("engine and processes")
    group.add_argument(
        "--engine",
        choices=ENGINES,
        default="qkv",
        help="what decodes translations: qkv (default) or ctranslate2 (each translation run converted at start, "
        "as qkv translate --engine ctranslate2 converts it; beam search then divides by len ** alpha, so a "
        "request's penalty must be power). Language models and encoders keep qkv's engine",
    )
    group.add_argument(
        "--workers",
        type=int,
        default=1,
        help="server processes sharing the port, each with its own copy of the models (memory times N; "
        f"default 1, at most {MAX_WORKERS})",
    )
    group.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM or Ctrl-C: seconds the requests in flight have to finish, new ones answered 503, "
        "before the server stops (default 30)",
    )


def add_operations_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare who may call the server and what it logs: ``--api-key``, ``--no-api-key``,
    ``--access-log`` and ``--no-access-log`` (see :mod:`qkv.serve.access`).

    Args:
        parser: the ``serve`` subcommand's parser, to add the group to.
    """
    group = parser.add_argument_group("keys and logs")
    group.add_argument(
        "--api-key",
        metavar="KEY",
        help="the key every request but GET /health must send, as Authorization: Bearer KEY or X-API-Key: KEY "
        "(401 otherwise). Prefer the environment variable QKV_API_KEY: a flag shows in ps. Required (one or "
        "the other) when --host is not a loopback address",
    )
    group.add_argument(
        "--no-api-key",
        action="store_true",
        help="serve without a key on an address other machines can reach (a warning is logged)",
    )
    logs = group.add_mutually_exclusive_group()
    logs.add_argument(
        "--access-log",
        metavar="PATH",
        default=None,  # stderr (not "-" here: argparse would take a given "-" for the default, unchecked)
        help="where the access log goes, one JSON object per request: a file appended to, or - for stderr (default)",
    )
    logs.add_argument("--no-access-log", action="store_true", help="write no access log")


def serve_api_key(args: argparse.Namespace) -> str | None:
    """The key the server asks for: ``--api-key``'s, else ``$QKV_API_KEY``'s, else none; a ValueError
    for an address beyond this machine without a key or ``--no-api-key`` (the message never shows a key)."""
    import os

    from qkv.serve.access import api_key_of
    from qkv.serve.server import is_loopback, show_address

    return api_key_of(
        args.api_key, os.environ, host=show_address(args.host), loopback=is_loopback(args.host), waived=args.no_api_key
    )


def warn_about_old_options(args: argparse.Namespace) -> None:
    """``--timeout`` and ``--max-concurrent`` limited qkv 1.0's own HTTP server; other options replace them."""
    instead = {"timeout": "--header-timeout and --body-timeout", "max_concurrent": "--max-connections"}
    for flag, new in instead.items():
        if getattr(args, flag, None) is not None:
            print(f"warning: --{flag.replace('_', '-')} is ignored since qkv 1.1: use {new}", file=sys.stderr)


def check_arguments(args: argparse.Namespace) -> None:
    """Raise a one-line ValueError for an option out of range, before any model is opened."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535, got {args.port}")
    for flag in (
        "max_chars",
        "max_texts",
        "max_new_tokens",
        "max_batch_tokens",
        "max_queue",
        "max_connections",
        "max_generate_batch",
    ):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    for flag in ("header_timeout", "body_timeout"):
        if not 0 < getattr(args, flag) <= 3600:  # also refuses nan
            raise ValueError(f"--{flag.replace('_', '-')} must be more than 0 and at most 3600 seconds")
    if not 0 <= args.max_batch_wait <= 10_000:  # also refuses nan
        raise ValueError(f"--max-batch-wait must be between 0 and 10000 milliseconds, got {args.max_batch_wait}")
    if args.threads is not None and args.threads <= 0:
        raise ValueError(f"--threads must be positive, got {args.threads}")
    if not 1 <= args.workers <= MAX_WORKERS:
        raise ValueError(f"--workers must be between 1 and {MAX_WORKERS}, got {args.workers}")
    if not 0 <= args.drain_timeout <= 3600:  # also refuses nan
        raise ValueError(f"--drain-timeout must be between 0 and 3600 seconds, got {args.drain_timeout}")


def run(args: argparse.Namespace) -> int:
    """Run ``qkv serve``: check the options, open the models, draw the explorer's first page (so a
    broken model fails before serving) and serve the API and the explorer until interrupted.

    Args:
        args: the options :func:`add_arguments` declared, as parsed.

    Returns:
        The exit code: 0 once the server stops (SIGTERM or Ctrl-C, after its drain). An option out of
        range, a model that cannot be opened (by any worker), or an address that cannot be listened
        on, raises ``ValueError``, which the CLI reports as exit code 2.
    """
    from qkv.serve import check_installed

    check_arguments(args)
    warn_about_old_options(args)
    check_installed()
    from qkv.serve.access import close_access_log

    serve_api_key(args)  # refuses a network address without a key now, before any model is opened
    if args.workers > 1:  # the models are opened in each worker process, not here
        from qkv.serve.workers import serve_workers

        return serve_workers(args, open_server, lambda at, listing: print(startup_line(at, listing, args), flush=True))
    try:
        server, listing = open_server(args)
    except BaseException:
        close_access_log()
        raise
    print(startup_line(server.server_address, listing, args), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.server_close()
        close_access_log()
    return 0


def open_server(args: argparse.Namespace) -> tuple[Server, dict[str, dict[str, str]]]:
    """Open the models (each translation run converted when ``--engine ctranslate2``), draw the
    explorer's first page (so a broken model fails before serving) and bind the server (or, within
    :func:`qkv.serve.server.serving_on`, take the socket a ``--workers`` parent bound).

    Args:
        args: the checked options.

    Returns:
        The server, not yet serving, and each model's endpoint and engine by name.
    """
    from qkv.serve import server as serving
    from qkv.serve.access import open_access_log
    from qkv.serve.models import Limits, open_models
    from qkv.viz.app import ExplorerApp
    from qkv.viz.lm_explorer import CausalLMExplorer

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    models = open_models(args.model or [None], engine=args.engine, threads=args.threads)
    explorers = {name: served.explorer for name, served in models.items()}
    text = args.text
    if text is None:
        text, first = DEFAULT_TEXT, next(iter(explorers.values()))
        # a language model's tokenizer may not hold the default sentence's characters: its own sample then
        if isinstance(first, CausalLMExplorer) and first.sample_text and not first.encodes(text):
            text = first.sample_text
    app = ExplorerApp(explorers=explorers, max_chars=args.max_chars, initial_text=text)
    app.page()  # draw the first sentence now, so a broken model fails before serving
    limits = Limits(
        max_chars=args.max_chars,
        max_texts=args.max_texts,
        max_new_tokens=args.max_new_tokens,
        max_beam=args.max_beam,
        max_batch_wait_ms=args.max_batch_wait,
        max_batch_tokens=args.max_batch_tokens,
        max_queue=args.max_queue,
        max_generate_batch=args.max_generate_batch,
        max_connections=args.max_connections,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
    )
    open_access_log(None if args.no_access_log else args.access_log or "-")  # in each worker process, with --workers
    try:
        server = serving.make_server(
            app,
            models=models,
            host=args.host,
            port=args.port,
            limits=limits,
            allow_hosts=args.allow_host,
            api_key=serve_api_key(args),
            access_log=not args.no_access_log,
        )
    except OSError as err:  # the port is taken, the address is not this machine's, ...
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {err.strerror or err}") from None
    server.drain_timeout_s = args.drain_timeout
    return server, {name: {"endpoint": served.endpoint, "engine": served.engine} for name, served in models.items()}


def startup_line(address: tuple[str, int], listing: dict[str, dict[str, str]], args: argparse.Namespace) -> str:
    """The one line ``qkv serve`` prints once it serves: where, the models and their endpoints, batching,
    the engine (and the models it does not decode), the workers.

    Args:
        address: the bound ``(host, port)``.
        listing: each model's ``endpoint`` and ``engine`` by name (what :func:`open_server` returns).
        args: the options.

    Returns:
        The line, starting ``serving on http://HOST:PORT/`` (scripts read the address from it).
    """
    from qkv.serve.server import show_address

    served = ", ".join(f"{name} ({model['endpoint']})" for name, model in listing.items())
    batching = "off" if args.max_batch_wait == 0 else f"{args.max_batch_wait:g} ms"
    notes = ""
    if args.engine != "qkv":
        kept = [name for name, model in listing.items() if model["engine"] != args.engine]
        notes = f"; translations decoded by {args.engine}"
        if kept:  # a language model or an encoder: CTranslate2 here decodes translation runs only
            notes += f" ({', '.join(kept)}: qkv's engine)"
    if args.workers > 1:
        notes += f"; {args.workers} worker processes"
    return (
        f"serving on http://{show_address(str(address[0]), address[1])}/ (models: {served}; batching {batching}"
        f"{notes}; API docs at /docs; Ctrl-C to stop)"
    )
