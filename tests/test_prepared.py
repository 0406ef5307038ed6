"""Prepared folders (qkv prepare, qkv train --prepared) against independent references: the ids a
prepared folder holds are ``tokenizer.encode`` of each kept line (called here, line by line, not
through the CachedEncoder that prepare uses); a .gz corpus prepares to the same bytes as the plain
one; a task over a prepared split makes the same batches as a task over the text files; two gloo
processes take disjoint batches that together are the epoch's plan; a run resumed mid-epoch equals
the uninterrupted run; bad and misaligned input is reported by file:line or refused; CLI errors
exit 2 with one line and write nothing; a prepared folder that changed refuses resume.
"""

import gzip
import json
import random
import shutil

import dist_workers
import numpy as np
import pytest
import torch

from qkv.cli import main as qkv_main
from qkv.data.cached_encoder import LATIN_RANGES, CachedEncoder, split_pieces
from qkv.data.parallel import read_parallel
from qkv.data.prepared import PreparedCorpus
from qkv.data.prepared.preparing import prepare_corpus
from qkv.data.spec import DataSpec
from qkv.data.tokenizer import Tokenizer
from qkv.runs.translation import resume_run, start_run
from qkv.training.tasks import TranslationTask

MODEL = dict(d_model=32, num_heads=2, num_encoder_layers=1, num_decoder_layers=1, d_ff=64, dropout=0.1, max_len=48)
TRAIN = dict(
    max_tokens=400,
    warmup_steps=4,
    lr_factor=0.5,
    max_steps=6,
    max_minutes=0.0,
    bf16=False,
    progress=False,
    average_last=1,
    eval_every_minutes=0.0,
    checkpoint_every_minutes=0.0,
    log_every_steps=1,
)
WORDS = [
    "the",
    "house",
    "is",
    "small",
    "a",
    "dog",
    "runs",
    "over",
    "green",
    "fields",
    "don't",
    "we'll",
    "it's",
    "2014",
    "3.5",
    "Haus",
    "grün",
    "Straße",
    "über",
    "naïve",
    "😀",
    "-",
    ",",
    "(x)",
    "  ",
    "\t",
]


def sentence(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return text + rng.choice([".", " .", "!", "?", ""])


def write_pairs(folder, name, src, tgt, *, raw=False):
    paths = folder / f"{name}.src", folder / f"{name}.tgt"
    for path, lines in zip(paths, (src, tgt)):
        path.write_bytes(b"".join((x if raw else x.encode("utf-8")) + b"\n" for x in lines))
    return paths


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """600 clean pairs (ASCII and not, contractions, digits, runs of spaces and tabs), a few of them
    longer than the tests' 48 positions; a tokenizer learned on them; a prepared folder."""
    root = tmp_path_factory.mktemp("prepared")
    rng = random.Random(7)
    src = [sentence(rng, rng.choice([3, 6, 10, 14] if i % 50 else [60])) for i in range(600)]
    tgt = [sentence(rng, rng.choice([2, 5, 9, 12] if i % 70 else [60])) for i in range(600)]
    train = write_pairs(root, "train", src, tgt)
    valid = write_pairs(root, "valid", src[:20], tgt[:20])
    tokenizer = Tokenizer.train(src + tgt, vocab_size=400)
    tokenizer.save(root / "tokenizer.json")
    prepare_corpus(
        *train,
        root / "prep",
        val_src=valid[0],
        val_tgt=valid[1],
        tokenizer=root / "tokenizer.json",
        max_len=1000,
        workers=2,
        chunk_pairs=64,
        progress=False,
    )
    return {"root": root, "src": src, "tgt": tgt, "train": train, "tokenizer": tokenizer, "prep": root / "prep"}


def test_prepared_ids_are_the_tokenizers_ids_of_each_line(corpus):
    tokenizer, prepared = corpus["tokenizer"], PreparedCorpus(corpus["prep"])
    split = prepared.split("train")
    assert len(split) == 600 and prepared.manifest["dropped"]["train"] == {"empty": 0, "not_utf8": 0, "over_long": 0}
    for i in range(600):
        assert split.ids("src", i) == tokenizer.encode(corpus["src"][i]), i
        assert split.ids("tgt", i) == tokenizer.encode(corpus["tgt"][i]), i
    lengths = split.lengths()
    assert lengths.tolist() == [
        [len(tokenizer.encode(s)), len(tokenizer.encode(t))] for s, t in zip(corpus["src"], corpus["tgt"])
    ]
    assert prepared.text("valid").src == corpus["src"][:20]  # byte-level BPE decodes back to the text


def test_cached_encoder_equals_the_tokenizer_on_awkward_text(corpus):
    tokenizer = corpus["tokenizer"]
    texts = [
        "",
        " ",
        "a",
        "  two  spaces  ",
        "tab\tand\ttrailing \t",
        "it's we'll THEY'RE don't",
        "x</s>y",
        "</s>",
        "1234567 89",
        "(((",
        "naïve café",
        "\u3000wide\u00a0space",
        "line\rbreak",
        "a'b'c",
        "'s'",
        "end  ",
    ]
    encoder = CachedEncoder(tokenizer, cache_size=30)  # small: the cache starts again on the way
    for batch in (texts, [t for t in texts if t.isascii() and "</s>" not in t], texts[::-1], corpus["src"][:100]):
        ids, lengths = encoder.encode(batch)
        assert len(lengths) == len(batch) and lengths.sum() == len(ids)
        pieces = np.split(ids, np.cumsum(lengths)[:-1]) if len(batch) > 1 else [ids]
        assert [p.tolist() for p in pieces] == [tokenizer.encode(t) for t in batch]


def latin_characters() -> list[str]:
    """Every character of qkv.data.cached_encoder.LATIN_RANGES."""
    bounds = [ord(c) for c in LATIN_RANGES if c != "-"]
    return [chr(c) for lo, hi in zip(bounds[::2], bounds[1::2]) for c in range(lo, hi + 1)]


def test_the_python_split_is_the_tokenizers_on_every_latin_character():
    """CachedEncoder's own split (re on ASCII, the regex module on the other characters of its Latin
    ranges) gives the tokenizer's pre-tokenizer pieces, every character in several contexts."""
    from tokenizers import pre_tokenizers

    from qkv.viz.lm_explorer import BYTE_ALPHABET

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    chars = latin_characters()
    assert len(chars) > 1000 and "\u00e4" in chars and "\u2019" in chars and "\u20ac" in chars
    checked = 0
    for c in chars:
        for text in (
            c,
            f"a{c}b",
            f" {c}{c}x",
            f"1{c} 2",
            f"x {c} ",
            f"{c}  y",
            f"'{c}s",
            f"{c}\u00e9t\u00e9 {c}",
            f"{c}'ll",
        ):
            theirs = [
                bytes(BYTE_ALPHABET[ch] for ch in piece).decode("utf-8")
                for piece, _ in byte_level.pre_tokenize_str(text)
            ]
            assert split_pieces(text) == theirs, (hex(ord(c)), text)
            checked += 1
    assert checked == 9 * len(chars)


def test_cached_encoder_equals_the_tokenizer_on_german_and_french(multi30k_file):
    texts = []
    for lang in ("de", "fr"):
        with gzip.open(multi30k_file(f"train.{lang}.gz"), "rt", encoding="utf-8") as lines:
            texts += lines.read().splitlines()[:1500]
    assert sum(not t.isascii() for t in texts) > 1500  # most take the Latin path, not the ASCII one
    tokenizer = Tokenizer.train(texts, vocab_size=1000)
    encoder = CachedEncoder(tokenizer, cache_size=2000)
    ids, lengths = encoder.encode(texts)
    assert [p.tolist() for p in np.split(ids, np.cumsum(lengths)[:-1])] == [tokenizer.encode(t) for t in texts]


def test_a_gzipped_corpus_prepares_to_the_same_folder(corpus, tmp_path):
    gz = []
    for path in corpus["train"]:
        gz.append(tmp_path / (path.name + ".gz"))
        gz[-1].write_bytes(gzip.compress(path.read_bytes()))
    manifest = prepare_corpus(
        *gz,
        tmp_path / "from_gz",
        tokenizer=corpus["root"] / "tokenizer.json",
        max_len=1000,
        workers=1,
        chunk_pairs=100,
        progress=False,
    )
    plain = PreparedCorpus(corpus["prep"]).manifest
    assert manifest["splits"]["train"]["sha256"] == plain["splits"]["train"]["sha256"]
    for name in ("train.src.bin", "train.tgt.bin", "train.src.idx", "train.len", "train.lines"):
        assert (tmp_path / "from_gz" / name).read_bytes() == (corpus["prep"] / name).read_bytes(), name


def test_batches_from_a_prepared_folder_equal_batches_from_the_text_files(corpus):
    tokenizer = corpus["tokenizer"]
    from_text = TranslationTask(tokenizer, read_parallel(*corpus["train"]), None, max_len=48, pad_id=0)
    from_folder = TranslationTask(tokenizer, PreparedCorpus(corpus["prep"]).split("train"), None, max_len=48, pad_id=0)
    assert 0 < from_text.num_examples == from_folder.num_examples < 600  # the over-long pairs left out by both
    for epoch in (0, 1):
        text_plan, folder_plan = from_text.batches(epoch, 400, 3), from_folder.batches(epoch, 400, 3)
        assert len(text_plan) == len(folder_plan) > 5
        for a, b in zip(text_plan, folder_plan):
            x, y = from_text.make_batch(a), from_folder.make_batch(b)
            for name in ("src", "tgt_in", "tgt_out"):
                assert torch.equal(getattr(x, name), getattr(y, name))


def test_subword_dropout_cuts_a_prepared_folder_s_ids_without_changing_its_text(corpus):
    tokenizer = corpus["tokenizer"]
    plain = TranslationTask(tokenizer, PreparedCorpus(corpus["prep"]).split("train"), None, max_len=48, pad_id=0)
    cut = TranslationTask(tokenizer, PreparedCorpus(corpus["prep"]).split("train"), None, max_len=48, pad_id=0)
    cut.set_subword_dropout(0.3, seed=0)
    plan = cut.batches(1, 400, 3)
    assert sorted(i for b in plan for i in b) == sorted(i for b in plain.batches(1, 400, 3) for i in b)
    longer = 0
    for indices in plan:
        x, y = plain.make_batch(indices, 1), cut.make_batch(indices, 1)
        longer += int(y.num_tgt_tokens > x.num_tgt_tokens)
        for name in ("src", "tgt_out"):
            assert [tokenizer.decode(r) for r in getattr(x, name).tolist()] == [
                tokenizer.decode(r) for r in getattr(y, name).tolist()
            ]
    assert longer > len(plan) // 2


def _record_epoch(ctx, out: str, run_dir: str, folder: str) -> None:
    """Worker: start a run on the prepared folder on 2 processes, train one epoch, and write the
    example indices of the real (non-stand-in) batches this rank trained on."""
    from pathlib import Path

    trainer = start_run(
        run_dir,
        data=DataSpec(source="prepared", folder=folder),
        model_options=MODEL,
        train_options={**TRAIN, "max_steps": 0, "max_epochs": 1.0},
        device="cpu",
        dist=ctx,
    )
    made, trained = {}, []
    make_batch, step = trainer.task.make_batch, trainer.step

    def recording_make_batch(indices, epoch=0):
        batch = make_batch(indices, epoch)
        made[id(batch)] = list(indices)
        return batch

    def recording_step(batches):
        trained.extend(made[id(b)] for b in batches if b.num_tgt_tokens and id(b) in made)
        return step(batches)

    trainer.task.make_batch, trainer.step = recording_make_batch, recording_step
    trainer.train()
    Path(out, f"rank{ctx.rank}.json").write_text(json.dumps(trained))


def test_two_processes_take_disjoint_batches_that_cover_the_epoch(corpus, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dist_workers.launch(_record_epoch, (str(out), str(tmp_path / "run"), str(corpus["prep"])), timeout=240)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    task = TranslationTask(
        corpus["tokenizer"], PreparedCorpus(corpus["prep"]).split("train"), None, max_len=48, pad_id=0
    )
    plan = [list(b) for b in task.batches(0, TRAIN["max_tokens"], 0)]  # TrainConfig's default seed
    assert ranks[0] == plan[0::2] and ranks[1] == plan[1::2]  # accum 1: batch k goes to process k mod 2
    seen = [{i for b in r for i in b} for r in ranks]
    assert not seen[0] & seen[1]
    kept = {
        i
        for i in range(600)
        if max(len(corpus["tokenizer"].encode(corpus["src"][i])), len(corpus["tokenizer"].encode(corpus["tgt"][i]))) + 1
        <= 48
    }
    assert seen[0] | seen[1] == kept


def _metrics(run_dir):
    return [
        json.loads(x)
        for x in (run_dir / "metrics.jsonl").read_text().splitlines()
        if json.loads(x).get("event") == "train"
    ]


def test_a_run_resumed_mid_epoch_from_a_prepared_folder_equals_the_uninterrupted_run(corpus, tmp_path):
    data = DataSpec(source="prepared", folder=str(corpus["prep"]))
    start_run(tmp_path / "whole", data=data, model_options=MODEL, train_options=TRAIN, device="cpu")
    shutil.copytree(tmp_path / "whole", tmp_path / "halves")
    resume_run(tmp_path / "whole", device="cpu").train()
    first = resume_run(tmp_path / "halves", train_options={"max_steps": 3}, device="cpu")
    first.train()
    assert first.state.epoch == 0 and 0 < first.state.batch_in_epoch < len(first.task.batches(0, 400, 0))
    resume_run(tmp_path / "halves", train_options={"max_steps": 6}, device="cpu").train()
    whole = torch.load(tmp_path / "whole" / "state.pt", weights_only=True)
    halves = torch.load(tmp_path / "halves" / "state.pt", weights_only=True)
    assert whole["train_state"]["step"] == halves["train_state"]["step"] == 6
    for name, tensor in whole["model"].items():
        assert torch.equal(tensor, halves["model"][name]), name
    assert [m["loss"] for m in _metrics(tmp_path / "whole")] == [m["loss"] for m in _metrics(tmp_path / "halves")]
    assert len(_metrics(tmp_path / "whole")) == 6


def test_bad_lines_are_left_out_and_listed_by_file_and_line(corpus, tmp_path):
    src = [s.encode() for s in corpus["src"][:40]]
    tgt = [t.encode() for t in corpus["tgt"][:40]]
    tgt[4] = b""  # line 5: empty target
    src[9] = b"caf\xe9 au lait"  # line 10: Latin-1, not UTF-8
    src[19] = b" ".join([b"house"] * 60)  # line 20: over 32 tokens
    paths = write_pairs(tmp_path, "bad", src, tgt, raw=True)
    manifest = prepare_corpus(
        *paths, tmp_path / "out", tokenizer=corpus["root"] / "tokenizer.json", max_len=32, progress=False
    )
    dropped, listed = manifest["dropped"]["train"], manifest["dropped_first"]["train"]
    longer = {
        i + 1
        for i in range(40)
        if i not in (4, 9, 19)
        and max(len(corpus["tokenizer"].encode(corpus["src"][i])), len(corpus["tokenizer"].encode(corpus["tgt"][i])))
        + 1
        > 32
    }
    assert dropped == {"empty": 1, "not_utf8": 1, "over_long": 1 + len(longer)}
    assert f"{paths[1]}:5: empty line" in listed and f"{paths[0]}:10: not UTF-8" in listed
    assert any(x.startswith(f"{paths[0]}:20: too long") for x in listed)
    lines = np.fromfile(tmp_path / "out" / "train.lines", dtype=np.int64).tolist()
    assert lines == [n for n in range(1, 41) if n not in {5, 10, 20} | longer]
    split = PreparedCorpus(tmp_path / "out").split("train")
    assert [split.ids("src", k) for k in range(len(lines))] == [
        corpus["tokenizer"].encode(corpus["src"][n - 1]) for n in lines
    ]


def test_misaligned_files_are_refused_before_anything_is_written(corpus, tmp_path):
    paths = write_pairs(tmp_path, "mis", corpus["src"][:10], corpus["tgt"][:9])
    with pytest.raises(ValueError, match=r"misaligned.*10 lines.*9"):
        prepare_corpus(*paths, tmp_path / "out", tokenizer=corpus["root"] / "tokenizer.json", progress=False)
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["mis.src", "mis.tgt"]


def _cli(capsys, *argv):
    code = qkv_main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.strip()]


def test_cli_errors_exit_2_with_one_line_and_write_nothing(corpus, tmp_path, capsys):
    paths = write_pairs(tmp_path, "mis", corpus["src"][:10], corpus["tgt"][:9])
    (tmp_path / "not_prepared").mkdir()
    tiny = ["--d-model", 32, "--heads", 2, "--encoder-layers", 1, "--decoder-layers", 1, "--d-ff", 64]
    cases = [
        (["prepare", "--train-src", paths[0], "--train-tgt", paths[1], "--out", tmp_path / "p"], "misaligned"),
        (
            ["prepare", "--train-src", corpus["train"][0], "--train-tgt", corpus["train"][1], "--out", corpus["prep"]],
            "exists",
        ),
        (
            ["prepare", "--train-src", corpus["train"][0], "--train-tgt", tmp_path / "nope", "--out", tmp_path / "p"],
            "no such file",
        ),
        (
            [
                "prepare",
                "--train-src",
                corpus["train"][0],
                "--train-tgt",
                corpus["train"][1],
                "--out",
                tmp_path / "p",
                "--tokenizer",
                corpus["root"] / "tokenizer.json",
                "--vocab-size",
                500,
            ],
            "--vocab-size",
        ),
        (["train", "--prepared", tmp_path / "nope", "--run-dir", tmp_path / "r", *tiny], "no such folder"),
        (["train", "--prepared", tmp_path / "not_prepared", "--run-dir", tmp_path / "r"], "not a prepared folder"),
        (["train", "--prepared", corpus["prep"], "--data", "dates", "--run-dir", tmp_path / "r"], "one of"),
        (
            [
                "train",
                "--prepared",
                corpus["prep"],
                "--train-src",
                corpus["train"][0],
                "--train-tgt",
                corpus["train"][1],
                "--run-dir",
                tmp_path / "r",
            ],
            "one of",
        ),
        (["train", "--prepared", corpus["prep"], "--run-dir", tmp_path / "r", "--layers", 2], "--layers"),
    ]
    before = sorted(p.name for p in tmp_path.iterdir())
    manifest = (corpus["prep"] / "manifest.json").read_bytes()
    for argv, expected in cases:
        code, lines = _cli(capsys, *argv)
        assert code == 2, (argv, lines)
        assert len(lines) == 1 and expected in lines[0], (argv, lines)
        assert sorted(p.name for p in tmp_path.iterdir()) == before, argv
    assert (corpus["prep"] / "manifest.json").read_bytes() == manifest  # the existing folder untouched


def test_train_prepared_with_the_paper_recipe(corpus, tmp_path, capsys):
    code, lines = _cli(
        capsys,
        "train",
        "--prepared",
        corpus["prep"],
        "--recipe",
        "paper-base",
        "--run-dir",
        tmp_path / "run",
        "--d-model",
        32,
        "--heads",
        2,
        "--encoder-layers",
        1,
        "--decoder-layers",
        1,
        "--d-ff",
        64,
        "--max-len",
        48,
        "--max-tokens",
        400,
        "--accum-steps",
        1,
        "--max-steps",
        2,
        "--eval-every-steps",
        0,
        "--no-progress",
    )
    assert code == 0, lines
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data"] == {"source": "prepared", "folder": str(corpus["prep"].resolve())}
    assert config["prepared"]["fingerprint"] == PreparedCorpus(corpus["prep"]).fingerprint
    assert config["train"]["label_smoothing"] == 0.1 and list(config["train"]["adam_betas"]) == [0.9, 0.98]
    assert config["decode"] == {"beam_size": 4, "alpha": 0.6, "penalty": "gnmt"} and config["model"]["d_model"] == 32
    assert config["model"]["src_vocab_size"] == corpus["tokenizer"].vocab_size  # the folder's tokenizer
    assert not (tmp_path / "run" / "data").exists()  # no copy of the pairs: the folder is read in place


def test_a_changed_prepared_folder_refuses_resume(corpus, tmp_path, capsys):
    shutil.copytree(corpus["prep"], tmp_path / "prep")
    start_run(
        tmp_path / "run",
        data=DataSpec(source="prepared", folder=str(tmp_path / "prep")),
        model_options=MODEL,
        train_options={**TRAIN, "max_steps": 1},
        device="cpu",
    )
    # prepared again with a shorter --max-len: fewer pairs
    prepare_corpus(
        corpus["train"][0],
        corpus["train"][1],
        tmp_path / "prep",
        tokenizer=corpus["root"] / "tokenizer.json",
        max_len=40,
        overwrite=True,
        progress=False,
    )
    with pytest.raises(ValueError, match="changed since this run started"):
        resume_run(tmp_path / "run")
    state = (tmp_path / "run" / "state.pt").read_bytes()
    code, lines = _cli(capsys, "train", "--run-dir", tmp_path / "run", "--resume")
    assert code == 2 and len(lines) == 1 and "changed since this run started" in lines[0]
    assert (tmp_path / "run" / "state.pt").read_bytes() == state
