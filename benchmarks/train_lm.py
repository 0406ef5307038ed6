"""A character-level language model on tiny Shakespeare: qkv's CausalLM against Hugging Face's
GPT-2 (training tokens/s and validation loss), and a fixed-wall-time run of qkv's recipe.

Two parts, chosen by flags (both may be given; the comparison runs first):

``--compare``: qkv's :class:`~qkv.models.causal_lm.CausalLM` and ``transformers.GPT2LMHeadModel`` of the
same size (the recipe's d_model, heads, layers, d_ff, context, dropout and the character
vocabulary; random weights; HF with ``attn_implementation="sdpa"``) train side by side on the
same batches, made by qkv's own data path (``CharTokenizer``, ``LanguageModelTask.batches`` /
``make_batch``), so both see identical tensors in the same order. Every step of both is
:meth:`qkv.training.Trainer.step` with one :class:`~qkv.training.TrainConfig`: the summed
next-token cross-entropy divided by the step's tokens (the mean), gradient clipping at 1.0,
``torch.optim.Adam`` with the recipe's betas, epsilon and inverse-square-root schedule. qkv's loss
is ``model.loss(ids, targets)`` (its fused loss); HF's is ``F.cross_entropy`` over the logits of
``GPT2LMHeadModel(input_ids=ids)`` against the same targets (no ``labels`` passed, so no shift
inside HF). Rounds are interleaved (round 0: qkv then HF, round 1: HF then qkv, ...), each
model training ``--steps`` timed steps a round after ``--warmup`` untimed ones. Reported: training
tokens/s per model per round, the medians and the ratio qkv/HF, and the validation loss of each
on the whole validation split before and after the same steps.

``--minutes M``: qkv's recipe (``qkv.runs.recipes.RECIPES["tinyshakespeare"]``) through ``start_run`` +
``run_training`` for M minutes of wall time (``--minutes`` alone: the recipe's 30), then the
validation loss against minutes (from the run's metrics.jsonl; the engine validates on the first
``eval_sentences`` windows), the final validation loss in nats/char and bits/char over the WHOLE
validation split with the final weights, a 500-character sample (``model.generate``, prompt
"ROMEO:", temperature 0.8, top_k 200, seed 0: nanoGPT's sampling settings; top_k 200 restricts
nothing over a 65-character vocabulary) and the curve as a PNG beside the JSON.

The real runs (an otherwise idle machine; each JSON records the load average):

    python benchmarks/train_lm.py --compare     # benchmarks/results/language-model/lm_vs_hf.json
    python benchmarks/train_lm.py --minutes 30  # benchmarks/results/language-model/lm_tinyshakespeare.json + .png,
                                                # run folder runs/lm-tinyshakespeare

Smoke tests (seconds; results into /tmp, never into benchmarks/results):

    python benchmarks/train_lm.py --compare --steps 2 --warmup 1 --rounds 1 --d-model 32 --layers 1 \\
        --d-ff 128 --max-tokens 1024 --threads 1 --out-dir /tmp/lm-smoke
    python benchmarks/train_lm.py --minutes 0.2 --d-model 32 --layers 1 --d-ff 128 --max-tokens 1024 \\
        --eval-every-minutes 0.05 --threads 1 --run-dir /tmp/lm-smoke/run --out-dir /tmp/lm-smoke
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from qkv.bench.provenance import git_commit, utc_now, write_result
from qkv.bench.results import check_result_file
from qkv.bench.timing import environment
from qkv.data.spec import DataSpec
from qkv.data.text import load_text_splits, read_tokens, train_text_tokenizer
from qkv.models.causal_lm import IGNORE, CausalLM, CausalLMConfig
from qkv.runs.curves import plot_metrics, read_metrics
from qkv.runs.recipes import RECIPES
from qkv.runs.translation import run_training, start_run
from qkv.runtime.device import pick_device
from qkv.runtime.fileio import read_json, write_json
from qkv.runtime.precision import autocast_context
from qkv.training import LanguageModelTask, TrainConfig, Trainer
from qkv.training.objectives import Objective, cross_entropy_smoothing
from qkv.training.tasks import language_model_loss

REPO = Path(__file__).resolve().parent.parent
RECIPE = RECIPES["tinyshakespeare"]
# command-line option -> CausalLMConfig field
MODEL_OPTIONS = {
    "d_model": "d_model",
    "heads": "num_heads",
    "layers": "num_layers",
    "d_ff": "d_ff",
    "context": "context",
    "dropout": "dropout",
}
# command-line option -> TrainConfig field
TRAIN_OPTIONS = {
    "max_tokens": "max_tokens",
    "warmup_lr": "warmup_steps",
    "lr_factor": "lr_factor",
    "eval_every_minutes": "eval_every_minutes",
    "eval_windows": "eval_sentences",
    "checkpoint_every_minutes": "checkpoint_every_minutes",
    "average_last": "average_last",
}


def machine(threads: int) -> dict:
    """What the figures were measured on: :func:`qkv.bench.timing.environment` (CPU, its bf16 flags, load)."""
    return {**environment(), "threads": threads, "platform": platform.platform()}


# ------------------------------------------------------------------ evaluation on a whole split
@torch.no_grad()
def whole_split_loss(
    model: torch.nn.Module,
    loss_fn,
    tokens: np.ndarray,
    context: int,
    *,
    bf16: bool = False,
    windows_per_batch: int = 16,
) -> dict:
    """Mean next-token loss over EVERY token of ``tokens`` after the first: the non-overlapping
    windows of ``context`` tokens (as the engine's validation reads them, but all of them), then
    one window ending at the last token that scores only the targets the others left out. Each
    token is predicted from the tokens before it within its window (at most ``context``).
    ``loss_fn(model, ids, targets)`` returns the summed loss (``IGNORE`` targets add nothing)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    n = len(tokens)
    full = (n - 1) // context  # windows whose context + 1 tokens all fit
    starts = [i * context for i in range(full)]
    total, count = 0.0, 0
    try:
        with autocast_context(device, bf16):
            for i in range(0, len(starts), windows_per_batch):
                rows = np.stack(
                    [np.asarray(tokens[s : s + context + 1], dtype=np.int64) for s in starts[i : i + windows_per_batch]]
                )
                block = torch.from_numpy(rows).to(device)
                total += float(loss_fn(model, block[:, :-1], block[:, 1:]))
                count += block[:, 1:].numel()
            covered = full * context  # targets 1 .. covered are scored
            if covered < n - 1:
                start = n - 1 - context
                block = torch.from_numpy(np.asarray(tokens[start:], dtype=np.int64)[None]).to(device)
                targets = block[:, 1:].clone()
                already = covered - start  # targets at positions start+1 .. covered were scored above
                targets[:, :already] = IGNORE
                total += float(loss_fn(model, block[:, :-1], targets))
                count += int((targets != IGNORE).sum())
    finally:
        model.train(was_training)
    if count != n - 1:
        raise AssertionError(f"scored {count} targets of {n - 1}")
    loss = total / count
    return {"loss_nats_per_token": loss, "tokens": count, "windows": full + (covered < n - 1)}


SAMPLE_SETTINGS = ("prompt", "new_chars", "temperature", "top_k", "seed")


def write_sample(model: CausalLM, tokenizer, settings: dict) -> dict:
    """``settings`` (:data:`SAMPLE_SETTINGS`) with the text ``model.generate`` writes from them and its seconds."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(settings["seed"])
    prompt = torch.tensor([tokenizer.encode(settings["prompt"])], device=device)
    start = time.perf_counter()
    ids = model.generate(
        prompt, settings["new_chars"], temperature=settings["temperature"], top_k=settings["top_k"], generator=generator
    )
    return {
        **{k: settings[k] for k in SAMPLE_SETTINGS},
        "seconds": round(time.perf_counter() - start, 2),
        "text": tokenizer.decode(ids[0].tolist()),
    }


def best_weights_validation(
    run_dir: Path, valid_tokens: np.ndarray, chars_per_token: float, bf16: bool, sample: dict
) -> dict:
    """The whole validation split scored with the run's ``best.safetensors`` (the weights of the
    engine's best validation during training, on its first ``eval_sentences`` windows; the recipe's
    ``model.safetensors``, what ``qkv generate/evaluate`` use), and a sample from them with the
    ``sample`` settings (prompt, new_chars, temperature, top_k, seed)."""
    from qkv.runs.folder import load_run

    model, tokenizer, _ = load_run(run_dir, "best", task="lm")
    whole = whole_split_loss(model, language_model_loss, valid_tokens, model.config.context, bf16=bf16)
    nats = whole["loss_nats_per_token"] / chars_per_token
    return {
        "weights": "best.safetensors",
        "whole_split": {**whole, "nats_per_char": nats, "bits_per_char": nats / math.log(2)},
        "sample": write_sample(model, tokenizer, sample),
    }


def test_split(run_dir: Path, bf16: bool) -> dict | None:
    """The test split (the text's last 5%, which training, validation and checkpoint choice never
    read) scored once, whole, with the weights ``qkv evaluate`` uses (the recipe's ``best.safetensors``);
    None for a run without one (trained with --val-text and no --test-text)."""
    from qkv.runs.folder import load_run, read_run_config

    splits = read_run_config(run_dir).get("lm", {}).get("splits") or {}
    if not splits.get("test"):
        return None
    model, _, _ = load_run(run_dir, "best", task="lm")
    tokens = read_tokens(run_dir / "test.bin", model.config.vocab_size)
    whole = whole_split_loss(model, language_model_loss, tokens, model.config.context, bf16=bf16)
    chars_per_token = splits["test"]["chars_per_token"]
    nats = whole["loss_nats_per_token"] / chars_per_token
    print(
        f"test split (whole, {whole['tokens']} tokens), best weights: {nats:.4f} nats/char, "
        f"{nats / math.log(2):.4f} bits/char",
        flush=True,
    )
    return {
        "weights": "best.safetensors",
        "whole_split": {
            **whole,
            "nats_per_char": nats,
            "bits_per_char": nats / math.log(2),
            "chars_per_token": chars_per_token,
        },
        "splits": splits,
    }


# ------------------------------------------------------------------ the comparison
def hf_loss(
    model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor, *, objective: Objective | None = None
) -> torch.Tensor:
    """Summed cross-entropy of ``GPT2LMHeadModel``'s logits against ``targets`` (like
    :meth:`CausalLM.loss`: ``ids`` and ``targets`` are already shifted, ``IGNORE`` adds nothing),
    with ``objective``'s label smoothing."""
    logits = model(input_ids=ids, use_cache=False).logits  # (b, s, V)
    return F.cross_entropy(
        logits.flatten(0, 1).float(),
        targets.flatten(),
        ignore_index=IGNORE,
        reduction="sum",
        label_smoothing=cross_entropy_smoothing(objective),
    )


class HFTask:
    """What :meth:`Trainer.step` needs of a task, for the HF model: its loss call."""

    loss_fn = staticmethod(hf_loss)
    loss = staticmethod(LanguageModelTask.loss)  # module(batch.ids, batch.targets, objective=...)


def gpt2_like(config: CausalLMConfig):
    """``transformers.GPT2LMHeadModel`` of ``config``'s sizes, random weights, SDPA attention."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if not (
        config.norm_first
        and config.positional == "learned"
        and config.activation == "gelu_tanh"
        and config.tie_output
        and config.bias
        and not config.scale_embedding
    ):
        raise ValueError(
            "the comparison needs qkv's GPT-2 layout (pre-LN, learned positions, gelu_tanh, tied output, biases)"
        )
    hf_config = GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.context,
        n_embd=config.d_model,
        n_layer=config.num_layers,
        n_head=config.num_heads,
        n_inner=config.d_ff,
        activation_function="gelu_new",  # GELU's tanh approximation, qkv's gelu_tanh
        resid_pdrop=config.dropout,
        embd_pdrop=config.dropout,
        attn_pdrop=config.attention_dropout,
        layer_norm_epsilon=config.layer_norm_eps,
        tie_word_embeddings=True,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(hf_config)


def compare(args: argparse.Namespace, out_dir: Path) -> dict:
    import transformers

    data = DataSpec(source="tinyshakespeare", folder=args.data)
    train_text, valid_text, where = load_text_splits(data)
    # as start_run does: the character vocabulary covers the validation text too
    tokenizer = train_text_tokenizer("char", train_text + valid_text)
    train_ids = np.asarray(tokenizer.encode(train_text), dtype=np.int64)
    valid_ids = np.asarray(tokenizer.encode(valid_text), dtype=np.int64)
    config = CausalLMConfig(**{**RECIPE["model"], **model_options(args), "vocab_size": tokenizer.vocab_size})
    train_config = TrainConfig.from_dict(
        {**RECIPE["train"], **train_options(args), "bf16": args.bf16, "seed": args.seed, "progress": False}
    )
    task = LanguageModelTask(tokenizer, train_ids, valid_ids, context=config.context, windows="random")

    total_steps = args.warmup + args.rounds * args.steps
    batches, epoch = [], 0
    while len(batches) < total_steps:  # the first batches of the recipe's own batch order
        batches += [task.make_batch(starts) for starts in task.batches(epoch, train_config.max_tokens, args.seed)]
        epoch += 1
    batches = batches[:total_steps]

    torch.manual_seed(args.seed)
    qkv_model = CausalLM(config)
    torch.manual_seed(args.seed)
    hf_model = gpt2_like(config)
    models = {"qkv": qkv_model, "hf": hf_model}
    loss_fns = {"qkv": language_model_loss, "hf": hf_loss}
    trainers = {
        "qkv": Trainer(qkv_model, task, train_config),
        "hf": Trainer(hf_model, HFTask(), train_config, d_model=config.d_model),
    }
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    if params["qkv"] != params["hf"]:
        logging.warning("parameter counts differ: %s", params)

    val_before = {
        name: whole_split_loss(m, loss_fns[name], valid_ids, config.context, bf16=args.bf16)
        for name, m in models.items()
    }
    train_loss = {name: [] for name in models}

    def train(name: str, chunk: list) -> tuple[float, int]:
        seconds, tokens = 0.0, 0
        for batch in chunk:
            start = time.perf_counter()
            stats = trainers[name].step([batch])
            seconds += time.perf_counter() - start
            tokens += stats.tokens
            train_loss[name].append(round(stats.loss / stats.tokens, 4))
        return seconds, tokens

    for name in models:  # untimed warm-up steps (allocator, oneDNN primitives), the same batches
        train(name, batches[: args.warmup])
    rounds = []
    for r in range(args.rounds):
        chunk = batches[args.warmup + r * args.steps : args.warmup + (r + 1) * args.steps]
        order = ["qkv", "hf"] if r % 2 == 0 else ["hf", "qkv"]
        entry = {"order": order}
        for name in order:
            seconds, tokens = train(name, chunk)
            entry[name] = {"tokens_per_s": tokens / seconds, "seconds": seconds, "tokens": tokens}
        entry["ratio_qkv_over_hf"] = entry["qkv"]["tokens_per_s"] / entry["hf"]["tokens_per_s"]
        rounds.append(entry)
        print(
            f"round {r}: qkv {entry['qkv']['tokens_per_s']:.0f} tokens/s, hf {entry['hf']['tokens_per_s']:.0f} "
            f"tokens/s, qkv/hf {entry['ratio_qkv_over_hf']:.3f}",
            flush=True,
        )
    median = {name: statistics.median(e[name]["tokens_per_s"] for e in rounds) for name in models}
    val_after = {
        name: whole_split_loss(m, loss_fns[name], valid_ids, config.context, bf16=args.bf16)
        for name, m in models.items()
    }
    for name in models:
        for v in (val_before[name], val_after[name]):
            v["bits_per_char"] = v["loss_nats_per_token"] / math.log(2)
    return {
        "benchmark": "tiny Shakespeare, character level: training tokens/s of qkv CausalLM vs transformers "
        "GPT2LMHeadModel of the same size, same batches, interleaved rounds",
        "command": " ".join(["python", *sys.argv]),
        "data": {
            "where": where,
            "train_tokens": len(train_ids),
            "valid_tokens": len(valid_ids),
            "vocab_size": tokenizer.vocab_size,
            "windows": "random",
            "tokens_per_step": batches[0].num_tgt_tokens,
        },
        "model": asdict(config),
        "parameters": params,
        "hf": {
            "class": "transformers.GPT2LMHeadModel",
            "transformers": transformers.__version__,
            "attn_implementation": hf_model.config._attn_implementation,
            "config": {
                k: getattr(hf_model.config, k)
                for k in (
                    "n_embd",
                    "n_head",
                    "n_layer",
                    "n_inner",
                    "n_positions",
                    "vocab_size",
                    "activation_function",
                    "resid_pdrop",
                    "embd_pdrop",
                    "attn_pdrop",
                    "layer_norm_epsilon",
                    "tie_word_embeddings",
                )
            },
        },
        "loss": "mean next-token cross-entropy over the step's tokens through qkv.training.Trainer.step (summed loss "
        "/ tokens): qkv = model.loss(ids, targets) (CausalLM.loss: plain product + F.cross_entropy when vocab <= d_model, else the fused loss); HF = F.cross_entropy("
        "logits, targets, reduction='sum') computed from GPT2LMHeadModel(input_ids=ids).logits (no labels "
        "passed); ids and targets are the same WindowBatch tensors for both",
        "optimizer": {
            "class": "torch.optim.Adam",
            "betas": train_config.adam_betas,
            "eps": train_config.adam_eps,
            "schedule": f"inverse sqrt: {train_config.lr_factor} * d_model^-0.5 * min(step^-0.5, step * "
            f"{train_config.warmup_steps}^-1.5)",
            "clip_norm": train_config.clip_norm,
            "bf16_autocast": train_config.bf16,
        },
        "dropout_note": "the same probability for both; qkv's feed-forward also drops out after its activation "
        "(the paper's layout), which GPT-2 does not: one extra dropout on a (tokens, d_ff) tensor "
        "per layer in qkv",
        "steps": {
            "warmup_untimed": args.warmup,
            "timed_per_round": args.steps,
            "rounds": args.rounds,
            "total_per_model": total_steps,
        },
        "tokens_per_s_median": median,
        "ratio_qkv_over_hf_median": median["qkv"] / median["hf"],
        "rounds": rounds,
        "train_loss_per_step": train_loss,
        "validation_whole_split": {
            "before": val_before,
            f"after_{total_steps}_steps": val_after,
            "how": "every validation token after the first, non-overlapping windows of "
            "the context, model.eval(), float32 unless bf16",
        },
        "seed": args.seed,
        "machine": machine(torch.get_num_threads()),
    }


# ------------------------------------------------------------------ the fixed-wall-time run
def fixed_time_run(args: argparse.Namespace, out_dir: Path) -> dict:
    from qkv.runtime.heap import limit_memory_growth

    run_dir = Path(args.run_dir or REPO / "runs" / "lm-tinyshakespeare")
    device = str(pick_device())  # CUDA where there is one, else the CPU
    train_options_ = {
        **train_options(args),
        "max_minutes": args.minutes,
        "seed": args.seed,
        "progress": sys.stderr.isatty(),
        "log_every_steps": 10,
    }
    if args.bf16:
        train_options_["bf16"] = True
    limit_memory_growth()  # as the CLI does, before the first oneDNN primitive
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    trainer = start_run(
        run_dir,
        data=DataSpec(source="tinyshakespeare", folder=args.data),
        model_options=model_options(args),
        train_options=train_options_,
        overwrite=True,
        device=device,
        recipe="tinyshakespeare",  # named: on a GPU the data's default would be tinyshakespeare-gpu
    )
    prep_seconds = time.perf_counter() - t0
    train_start = time.perf_counter()
    run_training(trainer)
    train_wall = time.perf_counter() - train_start
    state, task, config = trainer.state, trainer.task, trainer.config
    model = trainer.plain_model()  # the final weights (the recipe averages nothing: average_last 1)

    eval_start = time.perf_counter()
    whole = whole_split_loss(model, language_model_loss, task.valid_tokens, model.config.context, bf16=config.bf16)
    nats_per_char = whole["loss_nats_per_token"] / task.chars_per_token
    model.eval()
    engine_view = task.validate(model, config.eval_sentences, config.bf16)  # the curve's own measure, at the end
    engine_view.pop("score", None)
    eval_seconds = time.perf_counter() - eval_start

    settings = {
        "prompt": args.prompt,
        "new_chars": args.sample_chars,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "seed": args.sample_seed,
    }
    sample = write_sample(model, task.tokenizer, settings)

    records = read_metrics(trainer.metrics_path)
    curve = [
        {k: r[k] for k in ("minutes", "step", "val_loss", "val_bpc", "windows") if k in r}
        for r in records
        if r.get("event") == "valid"
    ]
    train_curve = [
        {k: r[k] for k in ("minutes", "step", "loss", "tokens_per_s") if k in r}
        for r in records
        if r.get("event") == "train"
    ]
    png = out_dir / "lm_tinyshakespeare.png"
    plot_metrics(trainer.metrics_path, png)
    print(
        f"final validation (whole split, {whole['tokens']} chars): {nats_per_char:.4f} nats/char, "
        f"{nats_per_char / math.log(2):.4f} bits/char",
        flush=True,
    )
    print(sample["text"], flush=True)
    return {
        "task": "tiny Shakespeare, character level, qkv's recipe (qkv.runs.recipes.RECIPES['tinyshakespeare'])",
        "command": " ".join(["python", *sys.argv]),
        "train_minutes_budget": args.minutes,
        "train_wall_seconds": round(train_wall, 1),
        "prep_seconds": round(prep_seconds, 1),
        "steps": state.step,
        "epochs": round(state.epoch + state.batch_in_epoch / max(1, len(trainer._epoch_batches(state.epoch))), 3),
        "train_tokens": state.tokens,
        "train_tokens_per_s": round(state.tokens / max(state.seconds, 1e-9), 1),
        "val_loss_vs_minutes": curve,
        "val_curve_note": f"validation during training: the first {config.eval_sentences} non-overlapping windows "
        "of the validation split (the engine's validate)",
        "train_loss_vs_minutes": train_curve,
        "final_validation": {
            "weights": "final (the last step's, in memory)",
            "whole_split": {
                **whole,
                "nats_per_char": nats_per_char,
                "bits_per_char": nats_per_char / math.log(2),
                "chars_per_token": task.chars_per_token,
            },
            f"first_{config.eval_sentences}_windows": engine_view,
            "eval_seconds": round(eval_seconds, 1),
        },
        "best_validation": best_weights_validation(
            run_dir, task.valid_tokens, task.chars_per_token, config.bf16, settings
        ),
        "test": test_split(run_dir, config.bf16),
        "sample": {"weights": "final", **sample},
        "curve_png": str(png),
        "model": asdict(model.config),
        "train": asdict(config),
        "parameters": sum(p.numel() for p in model.parameters()),
        "run_dir": str(run_dir),
        "machine": {
            **machine(torch.get_num_threads()),
            "device": device,
            "load_average_start": list(load_start),
            "load_average_end": list(os.getloadavg()),
        },
    }


# ------------------------------------------------------------------ options
def model_options(args: argparse.Namespace) -> dict:
    return {field: getattr(args, opt) for opt, field in MODEL_OPTIONS.items() if getattr(args, opt) is not None}


def train_options(args: argparse.Namespace) -> dict:
    return {field: getattr(args, opt) for opt, field in TRAIN_OPTIONS.items() if getattr(args, opt) is not None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", action="store_true", help="qkv CausalLM vs HF GPT2LMHeadModel, tokens/s and val loss")
    p.add_argument(
        "--minutes",
        type=float,
        nargs="?",
        const=RECIPE["train"]["max_minutes"],
        default=None,
        help=f"a fixed-wall-time run of qkv's recipe (alone: {RECIPE['train']['max_minutes']:g} minutes)",
    )
    p.add_argument(
        "--data",
        default=None,
        help="folder holding input.txt (default: $QKV_DATA/tinyshakespeare or the cache, downloaded if missing)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: every core)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out-dir",
        "--out",
        dest="out_dir",
        default=str(REPO / "benchmarks" / "results" / "language-model"),
        help="where lm_vs_hf.json, lm_tinyshakespeare.json and lm_tinyshakespeare.png go (existing ones "
        "are kept unless --overwrite)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace the result files already in --out-dir")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast (default: float32)")
    recipe_model = ", ".join(f"{k} {v}" for k, v in RECIPE["model"].items())
    m = p.add_argument_group(f"model (default: the recipe's {recipe_model})")
    m.add_argument("--d-model", type=int)
    m.add_argument("--heads", type=int)
    m.add_argument("--layers", type=int)
    m.add_argument("--d-ff", type=int)
    m.add_argument("--context", type=int)
    m.add_argument("--dropout", type=float)
    t = p.add_argument_group("training (default: the recipe's)")
    t.add_argument("--max-tokens", type=int, help="tokens a batch (max_tokens // context windows)")
    t.add_argument("--warmup-lr", type=int, help="learning-rate warmup steps")
    t.add_argument("--lr-factor", type=float)
    t.add_argument("--eval-every-minutes", type=float, help="--minutes: validate every N minutes")
    t.add_argument("--eval-windows", type=int, help="--minutes: windows validated during training")
    t.add_argument("--checkpoint-every-minutes", type=float)
    t.add_argument("--average-last", type=int)
    c = p.add_argument_group("--compare")
    c.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    c.add_argument("--steps", type=int, default=20, help="timed steps per model per round")
    c.add_argument("--warmup", type=int, default=3, help="untimed steps per model before the first round")
    g = p.add_argument_group("--minutes")
    g.add_argument("--run-dir", default=None, help="run folder (default runs/lm-tinyshakespeare; replaced)")
    g.add_argument(
        "--rescore-best",
        metavar="JSON",
        default=None,
        help="add the best weights' whole-split validation to a finished --minutes run's JSON (its run "
        "folder must still exist) and exit",
    )
    g.add_argument("--prompt", default="ROMEO:")
    g.add_argument("--sample-chars", type=int, default=500)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=200)
    g.add_argument("--sample-seed", type=int, default=0)
    args = p.parse_args()
    if args.rescore_best:
        report = read_json(args.rescore_best)
        run_dir = Path(report["run_dir"])
        tokens = read_tokens(run_dir / "val.bin", report["model"]["vocab_size"])
        chars_per_token = report["final_validation"]["whole_split"]["chars_per_token"]
        report["best_validation"] = best_weights_validation(
            run_dir, tokens, chars_per_token, report["train"]["bf16"], report["sample"]
        )
        report["best_validation"]["command"] = " ".join(["python", *sys.argv])
        # added to a finished run's result: the run's own date and commit stay, the rescoring's go here
        report["best_validation"].update(date=utc_now(), commit=git_commit())
        write_json(Path(args.rescore_best), report)
        print(f"best weights, whole split: {report['best_validation']['whole_split']['nats_per_char']:.4f} nats/char")
        return 0
    if not args.compare and args.minutes is None:
        p.error("choose --compare and/or --minutes [M]")
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--rounds and --steps must be >= 1, --warmup >= 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    out_dir = Path(args.out_dir)
    results = (["lm_vs_hf.json"] if args.compare else []) + (
        ["lm_tinyshakespeare.json", "lm_tinyshakespeare.png"] if args.minutes is not None else []
    )
    for name in results:  # before any work
        check_result_file(p, args, out_dir / name, flag="--out-dir")
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.compare:
        start = time.perf_counter()
        report = compare(args, out_dir)
        report["wall_seconds"] = round(time.perf_counter() - start, 1)
        write_result(out_dir / "lm_vs_hf.json", report)
        print(
            f"median tokens/s: qkv {report['tokens_per_s_median']['qkv']:.0f}, hf "
            f"{report['tokens_per_s_median']['hf']:.0f}, qkv/hf {report['ratio_qkv_over_hf_median']:.3f}; "
            f"val loss after {report['steps']['total_per_model']} steps: "
            + ", ".join(
                f"{k} {v['loss_nats_per_token']:.4f}"
                for k, v in list(report["validation_whole_split"].values())[1].items()
            ),
            flush=True,
        )
    if args.minutes is not None:
        start = time.perf_counter()
        report = fixed_time_run(args, out_dir)
        report["wall_seconds"] = round(time.perf_counter() - start, 1)
        write_result(out_dir / "lm_tinyshakespeare.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
