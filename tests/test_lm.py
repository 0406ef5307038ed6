"""Language models through the engine: text, tokenizers and token arrays; the task's windows; run
folders that start, resume exactly and are scored; ``qkv train/generate/evaluate`` on them, with
bad input refused before anything is written."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from qkv.data.spec import DataSpec
from qkv.data.text import CharTokenizer, load_text_splits, load_text_tokenizer, read_text, read_tokens
from qkv.models.causal_lm import CausalLM, CausalLMConfig
from qkv.runs.folder import load_run
from qkv.runs.translation import resume_run, run_training, start_run

MODEL = dict(d_model=32, num_heads=4, num_layers=2, d_ff=64, context=32, dropout=0.0)
TRAIN = dict(
    max_steps=6,
    max_minutes=0.0,
    max_tokens=256,
    warmup_steps=4,
    lr_factor=1.0,
    progress=False,
    eval_every_steps=3,
    eval_sentences=8,
    checkpoint_every_minutes=0.0,
    eval_every_minutes=0.0,
    average_last=1,
    log_every_steps=1,
)
TEXT = "".join(f"{'To be, or not to be' if i % 3 else 'that is the question'}: line {i}.\n" for i in range(300))


def qkv_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "qkv", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    (folder / "train.txt").write_text(TEXT, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def lm_run(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "lm"
    torch.manual_seed(0)
    trainer = start_run(
        run_dir,
        data=DataSpec(source="text", train_text=str(corpus / "train.txt")),
        model_options=MODEL,
        train_options=TRAIN,
        device="cpu",
    )
    run_training(trainer)
    return run_dir


def test_token_arrays_hold_what_the_tokenizer_gives(lm_run, corpus):
    train_text, valid_text, _ = load_text_splits({"source": "text", "train_text": str(corpus / "train.txt")})
    n = len(TEXT)  # 90% train, the next 5% validation (the last 5%, the test split: tests/test_lm_splits.py)
    assert (train_text, valid_text) == (TEXT[: n * 90 // 100], TEXT[n * 90 // 100 : n * 95 // 100])
    tokenizer = load_text_tokenizer(lm_run / "tokenizer.json")
    assert isinstance(tokenizer, CharTokenizer) and tokenizer.chars == sorted(set(TEXT))
    vocab = tokenizer.vocab_size
    assert read_tokens(lm_run / "train.bin", vocab).tolist() == [tokenizer.chars.index(c) for c in train_text]
    assert tokenizer.decode(read_tokens(lm_run / "val.bin", vocab)) == valid_text


def test_windows_are_reproducible_and_strided_ones_tile_the_text(lm_run):
    trainer = resume_run(lm_run)
    task = trainer.task
    assert task.batches(0, 256, 0) == task.batches(0, 256, 0) != task.batches(1, 256, 0)
    batch = task.make_batch(task.batches(0, 256, 0)[0])
    assert batch.ids.shape == (8, 32) and torch.equal(batch.ids[:, 1:], batch.targets[:, :-1])
    task.windows = "strided"
    starts = sorted(s for b in task.batches(0, 256, 0) for s in b)
    assert starts == list(range(0, task.num_examples * 32, 32))


def test_a_resumed_language_model_run_equals_an_uninterrupted_one(corpus, tmp_path):
    """A run stopped at step 4 and resumed to 6 ends where one run of 6 does. The schedule is one that
    does not depend on the budget (the recipe's cosine falls to zero at each budget's end)."""
    data = DataSpec(source="text", train_text=str(corpus / "train.txt"))
    train = {**TRAIN, "schedule": "inverse_sqrt"}
    torch.manual_seed(0)
    run_training(
        start_run(
            tmp_path / "straight", data=data, model_options={**MODEL, "dropout": 0.1}, train_options=train, device="cpu"
        )
    )
    torch.manual_seed(0)
    run_training(
        start_run(
            tmp_path / "halves",
            data=data,
            model_options={**MODEL, "dropout": 0.1},
            train_options={**train, "max_steps": 4},
            device="cpu",
        )
    )
    run_training(resume_run(tmp_path / "halves", train_options={"max_steps": 6}, device="cpu"))
    a = torch.load(tmp_path / "straight" / "state.pt", weights_only=True)
    b = torch.load(tmp_path / "halves" / "state.pt", weights_only=True)
    assert a["train_state"]["step"] == b["train_state"]["step"] == 6
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name


def test_the_runs_model_is_its_best_validation(lm_run):
    """The recipe's final_weights="best": model.safetensors is best.safetensors, the weights of the
    lowest validation loss logged, and those weights score that loss again."""
    config = json.loads((lm_run / "config.json").read_text())
    assert config["train"]["final_weights"] == "best"
    assert (lm_run / "model.safetensors").read_bytes() == (lm_run / "best.safetensors").read_bytes()
    logged = [json.loads(x) for x in (lm_run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["val_loss"] for r in logged if r.get("event") == "valid"]
    assert len(losses) == 2  # steps 3 and 6
    trainer = resume_run(lm_run)
    model, _, _ = load_run(lm_run)
    validated = trainer.task.validate(model, 8, config["train"]["bf16"])["val_loss"]  # as the run validated
    assert validated == pytest.approx(min(losses), abs=1e-4)


@pytest.mark.parametrize("final_weights", ["best", "average"])
def test_finish_writes_the_best_weights_only_when_asked(tmp_path, final_weights):
    """Trainer.finish with a best.safetensors that differs from the final weights (here: zeros)."""
    from qkv.training import LanguageModelTask, TrainConfig, Trainer
    from qkv.training.checkpoint_files import save_weights

    tokenizer = CharTokenizer(sorted(set(TEXT)))
    ids = np.asarray(tokenizer.encode(TEXT), dtype=np.int64)
    task = LanguageModelTask(tokenizer, ids[:4000], ids[4000:], context=32, windows="random")
    model = CausalLM(CausalLMConfig(vocab_size=tokenizer.vocab_size, **MODEL))
    trainer = Trainer(model, task, TrainConfig(**{**TRAIN, "final_weights": final_weights}), tmp_path)
    zeros = CausalLM(CausalLMConfig(vocab_size=tokenizer.vocab_size, **MODEL))
    for p in zeros.parameters():
        torch.nn.init.zeros_(p)
    save_weights(zeros, tmp_path / "best.safetensors")
    trainer.finish()
    written = load_file(str(tmp_path / "model.safetensors"))
    expected = zeros if final_weights == "best" else model
    assert all(torch.equal(written[k], v) for k, v in expected.state_dict().items() if k in written)
    assert set(written) and not all(
        torch.equal(written[k], v)
        for k, v in (model if final_weights == "best" else zeros).state_dict().items()
        if k in written
    )


def test_evaluate_reports_the_loss_an_independent_loop_computes(lm_run):
    result = qkv_cli("evaluate", str(lm_run), "--split", "val", "--json", "--threads", "1")
    assert result.returncode == 0, result.stderr
    scores = json.loads(result.stdout)
    assert scores["split"] == "val"
    model, tokenizer, config = load_run(lm_run)
    tokens = torch.from_numpy(np.asarray(read_tokens(lm_run / "val.bin", tokenizer.vocab_size), dtype=np.int64))
    context, total, count = model.config.context, 0.0, 0
    with torch.no_grad():
        for start in range(0, len(tokens) - context, context):
            window = tokens[start : start + context + 1]
            logits = model(window[None, :-1]).logits[0]  # the plain logits, not the fused loss
            total += float(F.cross_entropy(logits, window[1:], reduction="sum"))
            count += context
    assert scores["tokens"] == count
    assert scores["loss"] == pytest.approx(total / count, abs=1e-4)
    assert scores["bits_per_char"] == pytest.approx(total / count / math.log(2), abs=1e-4)  # characters = tokens


def test_generate_greedy_continues_like_a_plain_argmax_loop(lm_run):
    result = qkv_cli(
        "generate", str(lm_run), "--prompt", "To be", "--temperature", "0", "--max-new-tokens", "40", "--threads", "1"
    )
    assert result.returncode == 0, result.stderr
    model, tokenizer, _ = load_run(lm_run)
    ids = tokenizer.encode("To be")
    with torch.no_grad():
        for _ in range(40):  # no cache, the last `context` tokens each time
            logits = model(torch.tensor([ids[-model.config.context :]])).logits
            ids.append(int(logits[0, -1].argmax()))
    assert result.stdout == tokenizer.decode(ids) + "\n"


def test_generate_stops_at_a_stop_text_and_streams_a_sample(lm_run):
    result = qkv_cli(
        "generate",
        str(lm_run),
        "--prompt",
        "To",
        "--max-new-tokens",
        "200",
        "--seed",
        "3",
        "--stop",
        "\n",
        "--threads",
        "1",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("To") and result.stdout.count("\n") == 1  # cut at the first newline


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", "Zebra \u00e9"], "not in the model's vocabulary"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-k", "0"], "--top-k"),
    ],
)
def test_generate_refuses_bad_options_in_one_line(lm_run, args, message):
    result = qkv_cli("generate", str(lm_run), *args)
    assert result.returncode == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""


def test_a_translation_run_is_not_a_language_model(tmp_path):
    (tmp_path / "s.txt").write_text("a b\nc d\n" * 20)
    (tmp_path / "t.txt").write_text("x y\nz w\n" * 20)
    result = qkv_cli(
        "train",
        "--train-src",
        str(tmp_path / "s.txt"),
        "--train-tgt",
        str(tmp_path / "t.txt"),
        "--run-dir",
        str(tmp_path / "mt"),
        "--max-steps",
        "1",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--encoder-layers",
        "1",
        "--decoder-layers",
        "1",
        "--d-ff",
        "16",
        "--vocab-size",
        "260",
    )
    assert result.returncode == 0, result.stderr
    result = qkv_cli("generate", str(tmp_path / "mt"), "--prompt", "a")
    assert result.returncode == 2 and "a translation run" in result.stderr


def test_bad_text_is_refused_before_anything_is_written(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text(TEXT, encoding="utf-8")
    cases = {"empty.txt": b"  \n", "latin1.txt": "caf\u00e9\n".encode("latin-1")}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "short.txt").write_text("too short\n", encoding="utf-8")
    for extra, message in [
        (["--train-text", str(tmp_path / "empty.txt")], "empty"),
        (["--train-text", str(tmp_path / "latin1.txt")], "not UTF-8"),
        (["--train-text", str(good), "--val-text", str(tmp_path / "short.txt")], "fewer than one window"),
        (["--train-text", str(good), "--encoder-layers", "2"], "not an option of a language model"),
        (["--train-text", str(good), "--vocab-size", "300"], "--tokenizer bpe"),
        (["--data", "dates", "--tokenizer", "char"], "for a language model"),
        (["--task", "lm", "--data", "dates"], "--task lm does not fit --data dates"),
        (["--task", "translation", "--train-text", str(good)], "use --task lm"),
    ]:
        run_dir = tmp_path / "run"
        result = qkv_cli("train", *extra, "--run-dir", str(run_dir), "--max-steps", "1", "--context", "32")
        assert result.returncode == 2, (extra, result.stderr)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert not run_dir.exists()
    with pytest.raises(ValueError, match="latin1.txt:1: not UTF-8"):
        read_text(tmp_path / "latin1.txt")


def test_a_bpe_language_model_trains_and_generates(corpus, tmp_path):
    result = qkv_cli(
        "train",
        "--task",
        "lm",
        "--train-text",
        str(corpus / "train.txt"),
        "--tokenizer",
        "bpe",
        "--vocab-size",
        "300",
        "--run-dir",
        str(tmp_path / "bpe"),
        "--max-steps",
        "2",
        "--d-model",
        "32",
        "--heads",
        "2",
        "--layers",
        "1",
        "--d-ff",
        "32",
        "--context",
        "16",
        "--threads",
        "1",
    )
    assert result.returncode == 0, result.stderr
    model, tokenizer, config = load_run(tmp_path / "bpe")
    assert config["task"] == "lm" and config["lm"]["tokenizer"] == "bpe" and tokenizer.vocab_size == 300
    n = len(TEXT)
    assert tokenizer.decode(read_tokens(tmp_path / "bpe" / "val.bin", 300)) == TEXT[n * 90 // 100 : n * 95 // 100]
    assert tokenizer.decode(read_tokens(tmp_path / "bpe" / "test.bin", 300)) == TEXT[n * 95 // 100 :]
    result = qkv_cli("generate", str(tmp_path / "bpe"), "--prompt", "To be", "--max-new-tokens", "5", "--seed", "0")
    assert result.returncode == 0 and result.stdout.startswith("To be"), result.stderr
