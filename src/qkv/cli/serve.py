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

from qkv.cli.options import MAX_BEAM, beam_size

DEFAULT_TEXT = "time flies like an arrow"


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
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for the model (default: all cores)")
    # 1.0's limits of the hand-written server: still accepted, so scripts keep working, and ignored with a warning
    for gone in ("--timeout", "--max-concurrent"):
        parser.add_argument(gone, type=float, default=None, help=argparse.SUPPRESS)


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
    for flag in ("max_chars", "max_texts", "max_new_tokens", "max_batch_tokens", "max_queue", "max_connections"):
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


def run(args: argparse.Namespace) -> int:
    """Run ``qkv serve``: check the options, open the models, draw the explorer's first page (so a
    broken model fails before serving) and serve the API and the explorer until interrupted.

    Args:
        args: the options :func:`add_arguments` declared, as parsed.

    Returns:
        The exit code: 0 once the server stops (Ctrl-C). An option out of range, or an address
        that cannot be listened on, raises ``ValueError``, which the CLI reports as exit code 2.
    """
    from qkv.serve import check_installed

    check_arguments(args)
    warn_about_old_options(args)
    check_installed()
    from qkv.serve import server as serving
    from qkv.serve.models import Limits, open_models
    from qkv.viz.app import ExplorerApp
    from qkv.viz.lm_explorer import CausalLMExplorer

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    models = open_models(args.model or [None])
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
        max_connections=args.max_connections,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
    )
    try:
        server = serving.make_server(
            app, models=models, host=args.host, port=args.port, limits=limits, allow_hosts=args.allow_host
        )
    except OSError as err:  # the port is taken, the address is not this machine's, ...
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {err.strerror or err}") from None
    address = serving.show_address(str(server.server_address[0]), server.server_address[1])
    served = ", ".join(f"{name} ({served.endpoint})" for name, served in models.items())
    batching = "off" if args.max_batch_wait == 0 else f"{args.max_batch_wait:g} ms"
    print(
        f"serving on http://{address}/ (models: {served}; batching {batching}; API docs at /docs; Ctrl-C to stop)",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.server_close()
    return 0
