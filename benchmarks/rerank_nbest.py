"""Rerank beam search's n-best lists: a noisy-channel score from reverse-direction runs, and MBR.

Beam search keeps the hypotheses ``y`` that the forward model (a run, or several decoded as an
ensemble) finds likely; this script keeps all of them and picks again by

    log p(y | x) / ((5 + |y|) / 6) ** alpha  +  lambda * log p(x | y) / |x|

where ``p(x | y)`` is the "channel": runs trained the other way (De->En for an En->De forward
model; an ensemble when several), scoring the source given each hypothesis (Yee et al. 2019 add a
language model too; this has none). ``lambda`` 0 is plain reranking by length penalty. Also, with
``--mbr``, minimum-Bayes-risk selection: the hypothesis with the highest mean sentence-BLEU
against the others of its list. Every setting is chosen on the validation split; test 2016 is
decoded once and read only at the chosen settings.

    python benchmarks/rerank_nbest.py --forward RUN_EN_DE_A RUN_EN_DE_B --channel RUN_DE_EN_A RUN_DE_EN_B \\
        --beam 8 --alpha 1.0 --bf16 --mbr --out benchmarks/results/multi30k/ensembles/multi30k_en_de_rerank_val.json

The runs must share one tokenizer (trained on the same data), as for an ensemble.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import sacrebleu
import torch
from tqdm.auto import tqdm

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.bench.timing import environment
from qkv.data.batching import make_batch, pad_sequences
from qkv.data.sources import load_split
from qkv.decoding.ensemble import same_tokenizer
from qkv.decoding.search import beam_search
from qkv.decoding.translate import length_batches
from qkv.metrics.scores import score_translations
from qkv.runs.folder import load_translator
from qkv.runtime.precision import autocast_context


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def nbest_lists(model, tokenizer, src_ids, *, beam: int, alpha: float, bf16: bool, max_tokens: int = 4000):
    """Every finished hypothesis of beam search for each source: lists of (ids, log p)."""
    out = [None] * len(src_ids)
    with torch.no_grad(), autocast_context(torch.device("cpu"), bf16):
        for batch in tqdm(length_batches(src_ids, max(1, max_tokens // beam)), desc="n-best", leave=False):
            src = pad_sequences([src_ids[i] for i in batch], model.config.pad_id)
            found = beam_search(
                model,
                src,
                bos_id=tokenizer.bos_id,
                eos_id=tokenizer.eos_id,
                beam_size=beam,
                alpha=alpha,
                return_all=True,
            )
            for i, hyps in zip(batch, found):
                out[i] = [(h.tokens, h.score) for h in hyps] or [([], float("-inf"))]
    return out


def sequence_log_probs(
    model, tokenizer, src: list[list[int]], tgt: list[list[int]], *, bf16: bool, batch_size: int = 128
) -> list[float]:
    """``log p(tgt_i + EOS | src_i + EOS)`` under ``model`` (a Transformer or an Ensemble), teacher-forced."""
    limit = model.config.max_len - 2
    pad = model.config.pad_id
    out = [0.0] * len(src)
    order = sorted(range(len(src)), key=lambda j: len(src[j]) + len(tgt[j]))
    with torch.no_grad(), autocast_context(torch.device("cpu"), bf16):
        for start in tqdm(range(0, len(order), batch_size), desc="channel", leave=False):
            chunk = order[start : start + batch_size]
            batch = make_batch(
                [src[j][:limit] for j in chunk],
                [tgt[j][:limit] for j in chunk],
                pad_id=pad,
                bos_id=tokenizer.bos_id,
                eos_id=tokenizer.eos_id,
            )
            logits = model.decode(batch.tgt_in, model.encode(batch.src)).logits.float()
            picked = torch.log_softmax(logits, dim=-1).gather(-1, batch.tgt_out[..., None]).squeeze(-1)
            for j, value in zip(chunk, picked.masked_fill(batch.tgt_out == pad, 0.0).sum(-1).tolist()):
                out[j] = value
    return out


class Lists:
    """The n-best lists of one split, flattened, with what each candidate is scored by."""

    def __init__(self, forward, channel, tokenizer, split, args):
        self.refs = split.tgt
        limit = forward.config.max_len - 1
        src_ids = [s[:limit] + [tokenizer.eos_id] for s in tokenizer.encode_batch(split.src)]
        lists = nbest_lists(forward, tokenizer, src_ids, beam=args.beam, alpha=args.alpha, bf16=args.bf16)
        self.owner = np.array([i for i, hyps in enumerate(lists) for _ in hyps])
        self.groups = [np.flatnonzero(self.owner == i) for i in range(len(lists))]
        ids = [h[0] for hyps in lists for h in hyps]
        self.text = [tokenizer.decode(t) for t in ids]
        self.forward = np.array([h[1] for hyps in lists for h in hyps])
        self.tgt_len = np.array([len(t) + 1 for t in ids])  # EOS counted, as beam search counts it
        sources = [src_ids[i][:-1] for i in self.owner]
        self.src_len = np.array([len(s) + 1 for s in sources])
        self.channel = (
            np.array(sequence_log_probs(channel, tokenizer, ids, sources, bf16=args.bf16))
            if channel is not None
            else np.zeros(len(ids))
        )

    def pick(self, alpha: float, lam: float) -> list[str]:
        score = self.forward / ((5.0 + self.tgt_len) / 6.0) ** alpha + lam * self.channel / self.src_len
        return [self.text[g[np.argmax(score[g])]] for g in self.groups]

    def mbr(self) -> list[str]:
        chosen = []
        for g in self.groups:
            utility = [
                np.mean([sacrebleu.sentence_bleu(self.text[j], [self.text[o]]).score for o in g if o != j])
                if len(g) > 1
                else 0.0
                for j in g
            ]
            chosen.append(self.text[g[int(np.argmax(utility))]])
        return chosen


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--forward", nargs="+", required=True, help="the translation run(s) whose beam makes the lists")
    p.add_argument("--channel", nargs="*", default=[], help="run(s) trained the other way, scoring p(source | hyp)")
    p.add_argument("--beam", type=int, default=8)
    p.add_argument("--alpha", type=float, default=1.0, help="beam search's own length penalty")
    p.add_argument("--alphas", type=floats, default=[0.6, 1.0, 1.4, 2.0], help="length penalties to rerank with")
    p.add_argument(
        "--lambdas",
        type=floats,
        default=[0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0],
        help="channel weights to rerank with (only 0 without --channel)",
    )
    p.add_argument("--mbr", action="store_true", help="also MBR with sentence-BLEU (validation only)")
    p.add_argument("--bf16", action="store_true", help="decode and score under bf16 autocast")
    p.add_argument("--limit", type=non_negative, default=0, help="only the first N sentences of each split (0 = all)")
    p.add_argument("--threads", type=int, default=None)
    add_result_options(p, required=True)
    args = p.parse_args()
    if args.beam < 1 or not args.alphas or not args.lambdas:
        raise SystemExit("--beam must be >= 1 and --alphas / --lambdas non-empty")
    try:  # before any work: a bad --out or run folder is one line, not a traceback
        check_result_file(p, args)
        forward, tokenizer, config = load_translator(args.forward)
        channel = None
        if args.channel:
            channel, channel_tokenizer, channel_config = load_translator(args.channel)
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    lambdas = args.lambdas if args.channel else [0.0]
    forward.eval()
    if channel is not None:
        channel.eval()
        if not same_tokenizer(channel_tokenizer, tokenizer):
            raise SystemExit("the channel runs' tokenizer differs from the forward runs': train them on the same data")
        fwd_pair = (config["data"].get("src_lang"), config["data"].get("tgt_lang"))
        chan_pair = (channel_config["data"].get("src_lang"), channel_config["data"].get("tgt_lang"))
        if chan_pair != fwd_pair[::-1]:
            raise SystemExit(f"the channel runs translate {chan_pair}, not {fwd_pair[::-1]}")
    target_lang = config["data"].get("tgt_lang")
    start = time.perf_counter()
    splits = {}
    for name in ("val", "test"):
        split = load_split(config["data"], name)
        if args.limit:
            split = type(split)(split.src[: args.limit], split.tgt[: args.limit])
        splits[name] = Lists(forward, channel, tokenizer, split, args)
    seconds = time.perf_counter() - start
    val = splits["val"]
    rows = [
        {"alpha": a, "lambda": lam, "val_bleu": round(sacrebleu.corpus_bleu(val.pick(a, lam), [val.refs]).score, 2)}
        for lam in lambdas
        for a in args.alphas
    ]
    plain = max((r for r in rows if r["lambda"] == 0.0), key=lambda r: r["val_bleu"])
    best = max(rows, key=lambda r: r["val_bleu"])
    test = splits["test"]
    report = {
        "task": "rerank beam search's n-best lists on validation; test 2016 read at the chosen settings only",
        "forward": args.forward,
        "channel": args.channel,
        "beam": args.beam,
        "beam_alpha": args.alpha,
        "bf16": args.bf16,
        "sentences": {k: len(v.groups) for k, v in splits.items()},
        "mean_list_length": round(float(np.mean([len(g) for g in val.groups])), 2),
        "seconds_decoding_and_scoring": round(seconds, 1),
        "beam_top_val_bleu": round(sacrebleu.corpus_bleu(val.pick(args.alpha, 0.0), [val.refs]).score, 2),
        "grid_val": rows,
        "chosen_without_channel": {
            **plain,
            "test_2016": score_translations(test.pick(plain["alpha"], 0.0), test.refs, target_lang=target_lang),
        },
        "chosen": {
            **best,
            "test_2016": score_translations(
                test.pick(best["alpha"], best["lambda"]), test.refs, target_lang=target_lang
            ),
        },
        "machine": environment(),
    }
    if args.mbr:
        report["mbr_val_bleu"] = round(sacrebleu.corpus_bleu(val.mbr(), [val.refs]).score, 2)
    write_result(args.out, report)
    print(json.dumps({k: report[k] for k in ("beam_top_val_bleu", "mbr_val_bleu") if k in report}))
    for key in ("chosen_without_channel", "chosen"):
        row = report[key]
        print(
            f"{key}: alpha {row['alpha']} lambda {row['lambda']}: val {row['val_bleu']}, "
            f"test 2016 {row['test_2016']['bleu']} (papers' form {row['test_2016']['bleu_papers_form']['bleu']})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
