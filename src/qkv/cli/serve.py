"""``qkv serve``: the attention explorer as a local web app; type a sentence, see every head.

qkv serve                                       # all-MiniLM-L6-v2 on http://127.0.0.1:8000/
qkv serve --model runs/multi30k --model path/to/bert --port 8080
qkv serve --model runs/shakespeare              # a language model's causal self-attention
qkv serve --timeout 5 --max-concurrent 8        # tighter limits for slow or many clients
"""

from __future__ import annotations

import argparse
import math
import sys

DEFAULT_TEXT = "time flies like an arrow"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        action="append",
        help="a BERT or GPT-2 checkpoint folder, or a qkv translation or language-model run folder; "
        "repeat for several "
        "(default: all-MiniLM-L6-v2). Only these can be used from the page.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    parser.add_argument("--max-chars", type=int, default=500, help="longest accepted input (default 500 characters)")
    parser.add_argument(
        "--text",
        help=f"the sentence shown when the page opens (default {DEFAULT_TEXT!r}, or for a character-level "
        "language model whose vocabulary lacks its characters, the start of the run's own text)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="seconds a client has to send a whole request (and to take the answer); a client that stalls "
        "gets 408 and is disconnected (default 10)",
    )
    parser.add_argument(
        "--max-concurrent",
        type=int,
        default=32,
        help="connections served at once; more are turned away at once with 503 and Retry-After (default 32)",
    )


def check_arguments(args: argparse.Namespace) -> None:
    """Raise a one-line ValueError for an option out of range, before any model is opened."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535, got {args.port}")
    if args.max_chars <= 0:
        raise ValueError(f"--max-chars must be positive, got {args.max_chars}")
    if not 0 < args.timeout < math.inf:
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.max_concurrent <= 0:
        raise ValueError(f"--max-concurrent must be positive, got {args.max_concurrent}")


def run(args: argparse.Namespace) -> int:
    from qkv.viz.explorers import open_explorer
    from qkv.viz.server import ExplorerApp, make_server

    check_arguments(args)
    explorers = {}
    for path in args.model or [None]:
        explorer = open_explorer(path)
        name = explorer.name
        suffix = 2
        while name in explorers:  # two folders with the same name
            name, suffix = f"{explorer.name}-{suffix}", suffix + 1
        explorer.name = name
        explorers[name] = explorer
    text = args.text
    if text is None:
        text, first = DEFAULT_TEXT, next(iter(explorers.values()))
        # a language model's tokenizer may not hold the default sentence's characters: its own sample then
        if first.kind == "lm" and first.sample_text and not first.encodes(text):
            text = first.sample_text
    app = ExplorerApp(explorers=explorers, max_chars=args.max_chars, initial_text=text)
    app.page()  # draw the first sentence now, so a broken model fails before serving
    try:
        server = make_server(
            app, host=args.host, port=args.port, timeout=args.timeout, max_concurrent=args.max_concurrent
        )
    except OSError as err:  # the port is taken, the address is not this machine's, ...
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {err.strerror or err}") from None
    address = server.server_address  # a TCP server's: (host, port, ...)
    host, port = (address[0], address[1]) if isinstance(address, tuple) else (args.host, args.port)
    host = host.decode() if isinstance(host, (bytes, bytearray)) else host
    print(
        f"serving the attention explorer on http://{host}:{port}/ (models: {', '.join(explorers)}; Ctrl-C to stop)",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.server_close()
    return 0
