"""A trained translation run decoded by qkv and by its deployment exports: BLEU on Multi30k test 2016
and how many translations are identical.

* BLEU (sacreBLEU through qkv.metrics) of qkv's beam search with the run's beam size and alpha, in both
  length-penalty forms (``gnmt``, qkv's default, and ``power``, ``len ** alpha`` as CTranslate2 and
  Hugging Face divide), of CTranslate2 float32 (the power form, the same alpha: the only form it has)
  and of CTranslate2 int8 (weights quantized when loaded, as ``qkv translate --engine ctranslate2
  --quantization int8`` does);
* on the first ``--agreement-sentences`` sentences: identical translations between qkv (power form)
  and CTranslate2 float32, qkv greedy and the ONNX export's greedy (onnxruntime), qkv beam (power form)
  and Hugging Face ``generate`` on the ``--to hf`` export (``num_beams``, ``length_penalty`` = alpha,
  ``early_stopping=True``, each sentence limited as qkv limits it: source length + 50 tokens). For each
  CTranslate2 and Hugging Face disagreement, qkv's model scores both translations (teacher forcing,
  the power form): which search found the better-scoring one, or whether the two tie. Also CTranslate2
  float32 at its own default ``min_decoding_length=1`` (qkv's CTranslate2 engine passes 0: an empty
  translation is a finished hypothesis in qkv's search and Hugging Face's): what that setting changes.

Nothing is chosen on the test set: the beam size and alpha are the run's recorded ones. The exports are
written into a temporary folder, never into the run.

    python benchmarks/deploy_agreement.py --run /work/runs/en-de --threads 1
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from qkv.bench.provenance import write_result
from qkv.bench.results import add_result_options, check_result_file
from qkv.data.sources import load_split
from qkv.decoding.search import length_penalty
from qkv.decoding.translate import translate_texts
from qkv.export.ctranslate2 import Ct2Translator, export_ctranslate2
from qkv.export.huggingface import export_hf
from qkv.export.onnx import export_onnx
from qkv.export.onnx_runtime import OnnxTranslator
from qkv.metrics.scores import score_translations
from qkv.runs.folder import load_run
from qkv.runs.recipes import decode_settings
from qkv.runtime.machine import environment

OUT = Path(__file__).resolve().parent / "results" / "deploy" / "agreement_multi30k_en_de.json"
EXTRA_LEN = 50  # qkv's decoding limit: source length (EOS included) + 50, capped by the positional table


def timed(work: Callable[[], list[str]]) -> tuple[list[str], float]:
    start = time.perf_counter()
    out = work()
    return out, round(time.perf_counter() - start, 1)


def bleu(hyps: list[str], refs: list[str], lang: str) -> dict:
    scores = score_translations(hyps, refs, target_lang=lang)
    return {"bleu": round(scores["bleu"], 2), "signature": scores["bleu_signature"], "chrf": round(scores["chrf"], 2)}


def source_ids(tokenizer, texts: list[str], max_len: int) -> list[list[int]]:
    """The ids qkv decodes: each source cut to the positional table, EOS appended."""
    return [s[: max_len - 1] + [tokenizer.eos_id] for s in tokenizer.encode_batch(texts)]


class DefaultMinLength:
    """A ``ctranslate2.Translator`` left at CTranslate2's own ``min_decoding_length`` (1: EOS forbidden at the
    first step), where :class:`Ct2Translator` passes 0 as qkv decodes: what that setting changes."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def translate_batch(self, *args, **kwargs):
        kwargs.pop("min_decoding_length", None)
        return self.inner.translate_batch(*args, **kwargs)


def hf_generate(folder: Path, ids: list[list[int]], tokenizer, *, beam: int, alpha: float, max_len: int) -> list[str]:
    """Hugging Face ``generate`` on the Marian export, sentences of one length together (no padding), each
    allowed qkv's number of new tokens (its ``max_length`` counts the decoder's start token too)."""
    from transformers import MarianMTModel

    model = MarianMTModel.from_pretrained(str(folder)).eval()
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(ids):
        groups.setdefault(len(row), []).append(i)
    results = [""] * len(ids)
    for length, indices in groups.items():
        src = torch.tensor([ids[i] for i in indices])
        with torch.no_grad():
            out = model.generate(
                input_ids=src,
                attention_mask=torch.ones_like(src),
                num_beams=beam,
                length_penalty=alpha,
                early_stopping=True,
                do_sample=False,
                max_length=min(length + EXTRA_LEN, max_len - 1) + 1,
            )
        for i, row in zip(indices, out.tolist(), strict=True):
            tokens = row[1:]
            if tokenizer.eos_id in tokens:
                tokens = tokens[: tokens.index(tokenizer.eos_id)]
            results[i] = tokenizer.decode(tokens)
    return results


def power_score(model, src: list[int], hyp: str, tokenizer, alpha: float) -> float:
    """qkv's model's log-probability of ``hyp`` (EOS included) / length ** alpha (EOS counted)."""
    tgt = tokenizer.encode(hyp) + [tokenizer.eos_id]
    tgt_in = torch.tensor([[tokenizer.bos_id, *tgt[:-1]]])
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([src]), tgt_in).float(), dim=-1)[0]
    total = float(logp.gather(-1, torch.tensor(tgt)[:, None]).sum())
    return total / length_penalty(len(tgt), alpha, "power")


def agreement(ours: list[str], theirs: list[str], *, model=None, ids=None, tokenizer=None, alpha=None) -> dict:
    """Identical translations, and for the others (given ``model``) which one qkv's model scores higher."""
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    report: dict = {"identical": same, "of": len(ours)}
    if model is None:
        return report
    verdicts = {"qkv_higher": 0, "other_higher": 0, "tie_within_1e-4": 0}
    examples = []
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a == b:
            continue
        sa, sb = power_score(model, ids[i], a, tokenizer, alpha), power_score(model, ids[i], b, tokenizer, alpha)
        key = "tie_within_1e-4" if abs(sa - sb) <= 1e-4 else ("qkv_higher" if sa > sb else "other_higher")
        verdicts[key] += 1
        if len(examples) < 5:
            examples.append({"index": i, "qkv": a, "other": b, "qkv_score": round(sa, 5), "other_score": round(sb, 5)})
    report.update(different_by_qkv_model_score=verdicts, examples=examples)
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a trained Multi30k translation run folder (only read)")
    add_result_options(p, OUT)
    p.add_argument("--threads", type=int, default=1, help="CPU threads for every engine (default 1)")
    p.add_argument("--agreement-sentences", type=int, default=200)
    p.add_argument("--limit", type=int, default=0, help="only the first N test sentences (0 = all; for a dry run)")
    args = p.parse_args()
    args.out = check_result_file(p, args)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no bar per file written or read
    torch.set_num_threads(args.threads)
    model, tokenizer, config = load_run(args.run)
    model = model.float().eval()
    decode = decode_settings(config)
    beam, alpha = decode["beam_size"], decode["alpha"]
    lang = config["data"].get("tgt_lang", "de")
    test = load_split(config["data"], "test")
    src, refs = (test.src[: args.limit], test.tgt[: args.limit]) if args.limit else (test.src, test.tgt)
    n = min(args.agreement_sentences, len(src))
    max_len = model.config.max_len
    ids = source_ids(tokenizer, src, max_len)
    systems: dict[str, dict] = {}
    hyps: dict[str, list[str]] = {}

    def qkv(name: str, **settings) -> None:
        hyps[name], seconds = timed(lambda: translate_texts(model, tokenizer, src, **settings))
        systems[name] = {**settings, **bleu(hyps[name], refs, lang), "seconds": seconds}
        print(name, systems[name]["bleu"], f"{seconds} s", flush=True)

    qkv("qkv_beam_gnmt", beam_size=beam, alpha=alpha, penalty="gnmt")
    qkv("qkv_beam_power", beam_size=beam, alpha=alpha, penalty="power")
    with tempfile.TemporaryDirectory(prefix="qkv-deploy-agreement-") as tmp:
        folder = export_ctranslate2(args.run, Path(tmp) / "ct2")
        for compute_type in ("float32", "int8"):
            name = f"ct2_{compute_type}_beam_power"
            translator = Ct2Translator(folder, threads=args.threads, compute_type=compute_type)
            hyps[name], seconds = timed(lambda t=translator: t.translate(src, beam_size=beam, alpha=alpha))
            systems[name] = {"beam_size": beam, "alpha": alpha, "penalty": "power", "compute_type": compute_type}
            systems[name].update(**bleu(hyps[name], refs, lang), seconds=seconds)
            print(name, systems[name]["bleu"], f"{seconds} s", flush=True)
        translator.translator = DefaultMinLength(Ct2Translator(folder, threads=args.threads).translator)
        hyps["ct2_float32_min_length_1"] = translator.translate(src, beam_size=beam, alpha=alpha)
        greedy, greedy_seconds = timed(lambda: translate_texts(model, tokenizer, src[:n], beam_size=1))
        onnx = OnnxTranslator(export_onnx(args.run, Path(tmp) / "onnx"), threads=args.threads)
        onnx_greedy, onnx_seconds = timed(lambda: onnx.translate(src[:n]))
        hf_folder = export_hf(args.run, Path(tmp) / "hf")
        hf_beam, hf_seconds = timed(
            lambda: hf_generate(hf_folder, ids[:n], tokenizer, beam=beam, alpha=alpha, max_len=max_len)
        )
    f32 = hyps["ct2_float32_beam_power"]
    power = hyps["qkv_beam_power"]
    scored = dict(model=model, ids=ids, tokenizer=tokenizer, alpha=alpha)
    report = {
        "task": "qkv's decoding vs its CTranslate2, ONNX and Hugging Face exports on Multi30k test 2016",
        "run": str(Path(args.run).resolve()),
        "split": "test 2016",
        "sentences": len(src),
        "decode": {"beam_size": beam, "alpha": alpha, "source": "the run's recorded decode settings"},
        "threads": args.threads,
        "bleu": systems,
        "ct2_float32_minus_qkv_power_bleu": round(
            systems["ct2_float32_beam_power"]["bleu"] - systems["qkv_beam_power"]["bleu"], 2
        ),
        "ct2_float32_minus_qkv_gnmt_bleu": round(
            systems["ct2_float32_beam_power"]["bleu"] - systems["qkv_beam_gnmt"]["bleu"], 2
        ),
        "identical_all_sentences": {
            "qkv_power_vs_ct2_float32": agreement(power, f32, **scored),
            "qkv_power_vs_ct2_int8": agreement(power, hyps["ct2_int8_beam_power"]),
            "qkv_power_vs_ct2_float32_at_its_default_min_decoding_length_1": agreement(
                power, hyps["ct2_float32_min_length_1"], **scored
            ),
            "qkv_gnmt_vs_qkv_power": agreement(hyps["qkv_beam_gnmt"], power),
        },
        f"identical_first_{n}": {
            "qkv_power_vs_ct2_float32": agreement(power[:n], f32[:n]),
            "qkv_greedy_vs_onnx_greedy": agreement(greedy, onnx_greedy),
            "qkv_power_vs_hf_generate": agreement(power[:n], hf_beam, **scored),
        },
        "seconds_first_n": {"qkv_greedy": greedy_seconds, "onnx_greedy": onnx_seconds, "hf_generate_beam": hf_seconds},
        "machine": environment(),
    }
    write_result(args.out, report)
    print({k: v for k, v in report.items() if k.startswith("identical")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
