"""qkv serve's translation decoder: the inference object built once per served model (now) against
packing the weights on every request (before: translate_texts on the plain model), alternating in one
process, median of several rounds. Random weights of a base-sized Transformer (d_model 512, 6+6
layers) with the v0.1 fixture run's tokenizer; each request is one sentence, as in serve_load.json.

python benchmarks/serve_inference_object.py --rounds 5 --out benchmarks/results/deploy/serve_inference_object.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.decoding.translate import translate_texts
from qkv.inference import open_run
from qkv.models.transformer import Transformer, TransformerConfig
from qkv.serve.batching import DecodeKey
from qkv.serve.models import Limits
from qkv.serve.service import Service

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "runs_v0_1" / "translation_run"
SENTENCE = "A man in a blue shirt rides a bike down the street."


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=5, help="requests per round and path")
    add_result_options(parser, required=True)
    args = parser.parse_args()
    out = check_result_file(parser, args)  # before any work: an existing result is kept unless --overwrite
    torch.set_num_threads(1)
    torch.manual_seed(0)
    _, tokenizer, _ = open_run(FIXTURE)
    vocab = tokenizer.vocab_size
    config = TransformerConfig(src_vocab_size=vocab, tgt_vocab_size=vocab, max_len=64, dropout=0.0)
    model = Transformer(config).eval()
    limits = Limits()
    results = {}
    for beam in (1, 4):
        key = DecodeKey(beam, 0.6, "gnmt")
        new = Service._decoder(SimpleNamespace(limits=limits), SimpleNamespace(model=model, tokenizer=tokenizer))  # type: ignore[arg-type]

        def before(beam=beam):
            return translate_texts(
                model, tokenizer, [SENTENCE], beam_size=beam, max_batch_tokens=limits.max_batch_tokens
            )

        def now(key=key, new=new):
            return new([SENTENCE], key)

        assert before() == now()  # the same translations
        times: dict[str, list[float]] = {"before": [], "now": []}
        for _ in range(args.rounds):
            for name, work in (("before", before), ("now", now)):
                start = time.perf_counter()
                for _ in range(args.requests):
                    work()
                times[name].append((time.perf_counter() - start) / args.requests * 1000)
        median = {name: statistics.median(values) for name, values in times.items()}
        results[f"beam{beam}"] = {
            "ms_per_request_median": {name: round(value, 2) for name, value in median.items()},
            "ms_per_request_rounds": {name: [round(v, 2) for v in values] for name, values in times.items()},
            "speedup": round(median["before"] / median["now"], 3),
        }
        print(beam, results[f"beam{beam}"]["ms_per_request_median"], results[f"beam{beam}"]["speedup"])
    report = {
        "what": "qkv serve's decoder per one-sentence request: inference object built once (now) vs per request (before)",
        "settings": {
            "model": "Transformer d_model 512, 6+6 layers, random weights, max_len 64 (random weights decode to the length limit)",
            "threads": 1,
            "rounds": args.rounds,
            "requests_per_round": args.requests,
            "sentence": SENTENCE,
        },
        "results": results,
    }
    write_result(out, report)


if __name__ == "__main__":
    main()
