"""The attention explorer on long inputs (512, 2,048 and 4,096 tokens) in headless Chromium, beside bertviz's head view.

    python benchmarks/explorer_long_inputs.py                      # 256, 512 (BERT), 2,048, 4,096 (a language model)
    python benchmarks/explorer_long_inputs.py --sizes 512 2048     # some of them
    python benchmarks/explorer_long_inputs.py --no-bertviz         # qkv's pages only

The inputs: at 256 and 512 tokens all-MiniLM-L6-v2 (6 layers x 12 heads, its tokenizer allowed 512
wordpieces, as benchmarks/explorer_draw.py does); at 2,048 and 4,096 a qkv ``CausalLM`` with that
context, random weights (seed 0), 4 layers x 4 heads, d_model 64, over a character text. The page is
what ``qkv attend`` writes (``EncoderExplorer`` / ``CausalLMExplorer`` ``.example`` and
``qkv.viz.write_html``): at 512 every weight, at 2,048 and 4,096 the reduced form of
qkv.viz.long_inputs (each query's 8 largest weights and block means).

bertviz's head view (``pip install bertviz``, for this benchmark only: not a dependency of qkv) gets
the same attention tensors and tokens, ``head_view(..., html_action="return")``, its page written to
a file with its three scripts beside it instead of its CDN addresses, since the browser is offline:
require.js 2.3.6, d3 5.7.0 and jQuery 2.1.0 (bertviz asks for 2.0.0, which npm does not have), from
``npm install --prefix DIR requirejs@2.3.6 d3@5.7.0 jquery@2.1.0``, passed as ``--bertviz-js
DIR/node_modules``.

Measured in each page (``--repeats`` loads, medians), Chromium offline, viewport 1320 x 900:

* first picture: from navigation start to the first animation frame after the head view is drawn
  (qkv: ``<body data-renders>`` > 0; bertviz: its ``<svg>`` is in the page), polled each frame by a
  script added before the page's own;
* switch head: a click on a head's toggle (qkv: the head buttons; bertviz: its coloured head boxes)
  to the next frame with the head view redrawn, for two heads off and on again;
* switch layer (qkv only, the first time a layer is shown: its weights are decoded then);
* page memory: the JavaScript heap after a garbage collection (CDP ``Performance.getMetrics``
  ``JSHeapUsedSize``) and the ArrayBuffers outside it (``Runtime.getHeapUsage``
  ``backingStorageSize``: qkv's unpacked weights are typed arrays), once drawn.

Writes ``benchmarks/results/explorer/explorer_long_inputs.json`` with the machine. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]
LOAD_TIMEOUT_MS = 180_000

# before the page's own scripts: the time of the first frame in which `ready()` holds
FIRST_PICTURE = """(() => {
  const ready = () => %s;
  const poll = () => { if (ready()) { window.__firstPicture = performance.now(); } else { requestAnimationFrame(poll); } };
  requestAnimationFrame(poll);
})();"""
QKV_READY = "Number((document.body && document.body.dataset.renders) || 0) > 0"
BERTVIZ_READY = "Boolean(document.querySelector('#vis svg'))"

# a click on a head toggle, then the time to the next frame once the page has redrawn
QKV_CLICK = """async (selector) => {
  const before = Number(document.body.dataset.renders), t0 = performance.now();
  document.querySelector(selector).click();
  while (Number(document.body.dataset.renders) === before) { await new Promise(r => setTimeout(r, 1)); }
  await new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)));
  return performance.now() - t0;
}"""
QKV_LAYER = """async (layer) => {
  const before = Number(document.body.dataset.renders), t0 = performance.now(), select = document.querySelector('#layer-select');
  select.value = String(layer); select.dispatchEvent(new Event('change', {bubbles: true}));
  while (Number(document.body.dataset.renders) === before) { await new Promise(r => setTimeout(r, 1)); }
  await new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)));
  return performance.now() - t0;
}"""
BERTVIZ_CLICK = """async ([heads, head]) => {
  const boxes = Array.from(document.querySelectorAll('#vis svg > g')).find(
    g => g.querySelectorAll(':scope > rect').length === heads && !g.getAttribute('class'));
  const t0 = performance.now();
  boxes.querySelectorAll(':scope > rect')[head].dispatchEvent(new MouseEvent('click', {bubbles: true}));
  await new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)));
  return performance.now() - t0;
}"""

TEXT = "the quick brown fox jumps over the lazy dog while the cat sat on the mat. "


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 1) if values else None


def bert_input(tokens: int):
    """all-MiniLM-L6-v2's example of a ``tokens``-wordpiece sentence: (example, attention tensors, tokens, how)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from explorer_draw import sentence

    import qkv
    from qkv.pretrained import default_model_path
    from qkv.pretrained.tokenizer import WordPieceTokenizer
    from qkv.viz import EncoderExplorer

    model = qkv.load_pretrained(default_model_path(), device="cpu")
    model.tokenizer = WordPieceTokenizer(model.tokenizer.backend, max_length=tokens)
    explorer = EncoderExplorer(model=model, name="all-MiniLM-L6-v2")
    text = sentence(tokens, 0, model.tokenizer)
    example = explorer.example(text)
    (view,) = explorer.views(text)
    how = f"EncoderExplorer(all-MiniLM-L6-v2, tokenizer max_length {tokens}).example(text), 6 layers x 12 heads"
    return example, view.attentions, view.queries, how


def lm_input(tokens: int, layers: int, heads: int):
    """A random-weight CausalLM with context ``tokens`` over a character text of that length."""
    import torch

    from qkv.data.text import CharTokenizer
    from qkv.models.causal_lm import CausalLM, CausalLMConfig
    from qkv.viz.lm_explorer import CausalLMExplorer

    torch.manual_seed(0)
    text = (TEXT * (tokens // len(TEXT) + 1))[:tokens]
    tokenizer = CharTokenizer.train(text)
    config = CausalLMConfig(
        vocab_size=tokenizer.vocab_size,
        d_model=64,
        num_heads=heads,
        num_layers=layers,
        d_ff=128,
        context=tokens,
        dropout=0.0,
    )
    explorer = CausalLMExplorer(model=CausalLM(config), tokenizer=tokenizer, name=f"random CausalLM, context {tokens}")
    example = explorer.example(text)
    (view,) = explorer.views(text)
    how = f"CausalLMExplorer(CausalLM random weights, seed 0, {layers} layers x {heads} heads, d_model 64, context {tokens})"
    return example, view.attentions, view.queries, how


def cdp_memory_mb(context, page) -> tuple[float, float]:
    """The page's JavaScript heap in use (CDP ``Performance.getMetrics`` ``JSHeapUsedSize``) and the
    memory of its ArrayBuffers (``Runtime.getHeapUsage`` ``backingStorageSize``: typed arrays live
    outside the heap), after a garbage collection, in MB."""
    client = context.new_cdp_session(page)
    client.send("HeapProfiler.collectGarbage")
    client.send("Performance.enable")
    metrics = {m["name"]: m["value"] for m in client.send("Performance.getMetrics")["metrics"]}
    usage = client.send("Runtime.getHeapUsage")
    client.detach()
    return round(metrics["JSHeapUsedSize"] / 1e6, 1), round(usage.get("backingStorageSize", 0) / 1e6, 1)


def open_page(context, path: Path, ready: str):
    """Open ``path``; (the page, ms to its first picture) or (None, the error)."""
    page = context.new_page()
    page.add_init_script(FIRST_PICTURE % ready)
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    try:
        page.goto(path.as_uri(), timeout=LOAD_TIMEOUT_MS)
        page.wait_for_function("() => window.__firstPicture !== undefined", timeout=LOAD_TIMEOUT_MS)
    except Exception as err:  # noqa: BLE001 - a page that does not draw is a result here
        page.close()
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}" + (
            f"; page errors {errors[:2]}" if errors else ""
        )
    return page, page.evaluate("() => window.__firstPicture")


def measure(path: Path, kind: str, heads: int, layers: int, repeats: int) -> dict:
    from playwright.sync_api import sync_playwright

    ready = QKV_READY if kind == "qkv" else BERTVIZ_READY
    out: dict = {"page_mb": round(path.stat().st_size / 1e6, 1)}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        context = browser.new_context(viewport={"width": 1320, "height": 900})
        context.set_offline(True)
        firsts, heaps, switches, layer_switches = [], [], [], []
        for _ in range(repeats):
            page, first = open_page(context, path, ready)
            if page is None:
                out["error"] = first
                break
            firsts.append(first)
            heaps.append(cdp_memory_mb(context, page))
            for head in (1, 2, 1, 2):  # off, off, on, on
                if kind == "qkv":
                    switches.append(page.evaluate(QKV_CLICK, f"#head-toggles button[data-head='{head}']"))
                else:
                    switches.append(page.evaluate(BERTVIZ_CLICK, [heads, head]))
            if kind == "qkv" and layers > 1:
                layer_switches.append(page.evaluate(QKV_LAYER, layers - 1))
            page.close()
        out.update(
            {
                "first_picture_ms": median(firsts),
                "switch_head_ms": median(switches),
                "js_heap_mb": median([h[0] for h in heaps]),
                "array_buffers_mb": median([h[1] for h in heaps]),
                "runs_first_picture_ms": [round(v, 1) for v in firsts],
            }
        )
        if layer_switches:
            out["switch_layer_first_time_ms"] = median(layer_switches)
        context.close()
        browser.close()
    return out


def bertviz_page(attentions, tokens: list[str], folder: Path, js: Path) -> Path:
    """bertviz's head view of these weights as a file, its scripts beside it."""
    import torch
    from bertviz import head_view

    html = head_view(tuple(a[None].float() for a in attentions), list(tokens), html_action="return").data
    files = {
        "https://cdnjs.cloudflare.com/ajax/libs/require.js/2.3.6/require.min.js": js / "requirejs" / "require.js",
        "https://cdnjs.cloudflare.com/ajax/libs/d3/5.7.0/d3.min": js / "d3" / "dist" / "d3.min.js",
        "https://cdnjs.cloudflare.com/ajax/libs/jquery/2.0.0/jquery.min": js / "jquery" / "dist" / "jquery.min.js",
    }
    for url, source in files.items():
        if url not in html:
            raise SystemExit(f"bertviz's page no longer loads {url}; update this benchmark")
        shutil.copy(source, folder / source.name)
        local = source.name if url.endswith(".js") else source.name.removesuffix(".js")  # require.js paths: no .js
        html = html.replace(url, local)
    del torch
    path = folder / "bertviz.html"
    path.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{html}</body></html>")
    return path


def machine() -> dict:
    from qkv.bench.timing import environment

    info = environment()
    info["threads"] = os.cpu_count()
    info["chromium"] = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True).stdout.strip()
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[256, 512, 2048, 4096],
        help="tokens (up to 512: the BERT; more: the language model)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="page loads per figure (default 3)")
    parser.add_argument("--lm-layers", type=int, default=4)
    parser.add_argument("--lm-heads", type=int, default=4)
    parser.add_argument("--no-bertviz", action="store_true", help="qkv's pages only")
    parser.add_argument(
        "--bertviz-js",
        type=Path,
        default=None,
        help="a node_modules folder with requirejs@2.3.6, d3@5.7.0 and jquery@2.1.0 (npm install); "
        "needed for bertviz (its results JSON was made with one in /tmp/h2/npm)",
    )
    parser.add_argument(
        "--bertviz-max-weights",
        type=float,
        default=2e7,
        help="larger inputs are not handed to bertviz (recorded as not run)",
    )
    parser.add_argument("--note", default="", help="a note for the result, e.g. what else shared the machine")
    add_result_options(
        parser, REPO / "benchmarks" / "results" / "explorer" / "explorer_long_inputs.json", flag="--output"
    )
    args = parser.parse_args(argv)
    check_result_file(parser, args, flag="--output")  # before any work
    if not args.no_bertviz and args.bertviz_js is None:
        parser.error(
            "pass --bertviz-js DIR/node_modules (npm install --prefix DIR requirejs@2.3.6 d3@5.7.0 jquery@2.1.0) or --no-bertviz"
        )
    from qkv.viz import explorer_data, write_html
    from qkv.viz.long_inputs import is_reduced

    rows = []
    for size in args.sizes:
        load_before = [round(v, 2) for v in os.getloadavg()]
        t0 = time.perf_counter()
        if size <= 512:
            example, attentions, tokens, how = bert_input(size)
            layers, heads = 6, 12
        else:
            example, attentions, tokens, how = lm_input(size, args.lm_layers, args.lm_heads)
            layers, heads = args.lm_layers, args.lm_heads
        made_s = time.perf_counter() - t0
        view = example["views"][0]
        row: dict = {
            "tokens": size,
            "input": how,
            "layers": layers,
            "heads": heads,
            "weights": layers * heads * size * size,
            "attention_in_page": "reduced (top 8 per row + block means)"
            if is_reduced(view["attention"])
            else "every weight",
            "rollout_in_page": "reduced" if is_reduced(view.get("rollout")) else "every weight",
            "example_s": round(made_s, 1),
            "load_average_before": load_before,
        }
        with tempfile.TemporaryDirectory() as folder:
            t0 = time.perf_counter()
            page = write_html(explorer_data([example], title=f"qkv explorer, {size} tokens"), Path(folder) / "qkv.html")
            row["qkv_write_html_s"] = round(time.perf_counter() - t0, 1)
            row["qkv"] = measure(page, "qkv", heads, layers, args.repeats)
            print(f"{size}: qkv {json.dumps(row['qkv'])}", file=sys.stderr)
            del example
            if args.no_bertviz:
                pass
            elif row["weights"] > args.bertviz_max_weights:
                row["bertviz"] = {
                    "error": f"not run: head_view writes every weight as JSON text ({row['weights']:,} weights, "
                    f"about {row['weights'] * 46 / 1e9:.1f} GB of page at the 46 bytes per weight of its 512-token "
                    f"page), more than --bertviz-max-weights {args.bertviz_max_weights:,.0f}"
                }
            else:
                try:
                    t0 = time.perf_counter()
                    bv = bertviz_page(attentions, tokens, Path(folder), args.bertviz_js)
                    row["bertviz_html_s"] = round(time.perf_counter() - t0, 1)
                    row["bertviz"] = measure(bv, "bertviz", heads, layers, args.repeats)
                except (MemoryError, ValueError, OSError) as err:
                    row["bertviz"] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
                print(f"{size}: bertviz {json.dumps(row['bertviz'])}", file=sys.stderr)
        del attentions
        rows.append(row)
    try:
        from importlib.metadata import version

        bertviz_version = version("bertviz")
    except Exception:  # noqa: BLE001 - not installed
        bertviz_version = None
    result = {
        "benchmark": "the attention explorer on long inputs beside bertviz's head view, headless Chromium "
        "(benchmarks/explorer_long_inputs.py)",
        "command": "python benchmarks/explorer_long_inputs.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "repeats": args.repeats,
        "bertviz": bertviz_version,
        "note": args.note,
        "sizes": rows,
        "machine": machine(),
    }
    write_result(args.output, result)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
