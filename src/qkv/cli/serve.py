"""``qkv serve``: the attention explorer as a local web app; type a sentence, see every head.

    qkv serve                                       # all-MiniLM-L6-v2 on http://127.0.0.1:8000/
    qkv serve --model runs/multi30k --model path/to/bert --port 8080
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", action="append",
        help="a BERT checkpoint folder or qkv translation run folder; repeat for several "
             "(default: all-MiniLM-L6-v2). Only these can be used from the page.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    parser.add_argument("--max-chars", type=int, default=500, help="longest accepted input (default 500 characters)")
    parser.add_argument("--text", default="time flies like an arrow", help="the sentence shown when the page opens")


def run(args: argparse.Namespace) -> int:
    from qkv.viz.explorers import open_explorer
    from qkv.viz.server import ExplorerApp, make_server

    explorers = {}
    for path in args.model or [None]:
        explorer = open_explorer(path)
        name = explorer.name
        suffix = 2
        while name in explorers:  # two folders with the same name
            name, suffix = f"{explorer.name}-{suffix}", suffix + 1
        explorer.name = name
        explorers[name] = explorer
    app = ExplorerApp(explorers=explorers, max_chars=args.max_chars, initial_text=args.text)
    app.page()  # draw the first sentence now, so a broken model fails before serving
    server = make_server(app, host=args.host, port=args.port)
    host, port = server.server_address[:2]
    print(f"serving the attention explorer on http://{host}:{port}/ (models: {', '.join(explorers)}; Ctrl-C to stop)",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.server_close()
    return 0
