"""Training a translation Transformer: the paper's optimiser and schedule (section 5.3), label
smoothing (section 5.4), token-count batches, periodic validation, checkpoints, resume and
checkpoint averaging (section 6.1).

Seeds and thread counts are the caller's business (the CLI sets them); this module only saves and
restores the RNG state so that a resumed run continues exactly like an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from qkv import checkpoint as ckpt
from qkv.data.batching import make_batch, token_batches
from qkv.data.parallel import ParallelText
from qkv.data.sources import check_spec, describe, load_train_valid
from qkv.data.tokenizer import Tokenizer
from qkv.evaluation import exact_match, score_translations, translate_texts
from qkv.models import Transformer, TransformerConfig
from qkv.precision import autocast_context, bf16_is_fast

logger = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    """Options of a training run (saved in the run's config.json)."""

    max_tokens: int = 6000  # padded tokens per batch (max(source, target) length x sentences)
    accum_steps: int = 1  # batches whose gradients are summed into one optimizer step
    lr_factor: float = 1.0  # multiplies the paper's schedule d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    warmup_steps: int = 800  # linear warmup (the paper: 4000; too slow for a CPU hour)
    adam_betas: tuple[float, float] = (0.9, 0.98)  # section 5.3
    adam_eps: float = 1e-9
    label_smoothing: float = 0.1  # section 5.4
    clip_norm: float = 1.0  # gradient clipping on the global norm (0 = off)
    bf16: bool = False  # bfloat16 autocast (CPU or CUDA); weights and the optimizer stay float32
    compile: bool = False  # torch.compile the model's loss call (encoder + decoder; the fused loss stays eager)
    max_steps: int = 0  # stop after this many optimizer steps (0 = no limit)
    max_epochs: float = 0.0  # stop after this many passes over the data (0 = no limit)
    max_minutes: float = 0.0  # stop after this much wall time, validation included (0 = no limit)
    eval_every_steps: int = 0  # validate every N steps (0 = off)
    eval_every_minutes: float = 0.0  # validate every N minutes (0 = off)
    eval_sentences: int = 300  # validation subset decoded greedily for BLEU
    stop_at_exact_match: float = 0.0  # stop once validation exact match reaches this fraction (0 = off)
    checkpoint_every_steps: int = 0  # keep a checkpoint for averaging every N steps (0 = off)
    checkpoint_every_minutes: float = 0.0  # ... or every N minutes
    average_last: int = 5  # average this many kept checkpoints at the end (<= 1: no averaging)
    log_every_steps: int = 20  # write a training-loss line to metrics.jsonl every N steps
    seed: int = 0  # drives batch order (with the epoch number)
    progress: bool = True  # tqdm progress bar

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        """Build from a dict (e.g. config.json's ``train``); unknown keys raise ``ValueError``."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TrainConfig fields: {unknown}")
        data = dict(data)
        if "adam_betas" in data:
            data["adam_betas"] = tuple(data["adam_betas"])
        return cls(**data)


def inverse_sqrt_lr(step: int, d_model: int, warmup_steps: int, factor: float = 1.0) -> float:
    """The paper's learning rate (section 5.3, eq. 3) at optimizer step ``step`` (1-based):
    ``factor * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)``."""
    step = max(step, 1)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class TrainState:
    """Where a run stands; saved in state.pt with the optimizer and RNG states."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # current pass over the data
    batch_in_epoch: int = 0  # batches of the current epoch already consumed
    tokens: int = 0  # target tokens trained on
    seconds: float = 0.0  # wall time spent in the training loop (over all sessions)
    best_bleu: float = -1.0
    last_eval_seconds: float = 0.0
    last_checkpoint_seconds: float = 0.0
    kept_checkpoints: list | None = None
    stopped_early: bool = False  # a stop_at_exact_match target was reached


class Trainer:
    """Trains ``model`` on tokenised parallel text and writes everything into ``run_dir``.

    Args:
        model: the :class:`Transformer` to train (its config sizes the schedule).
        tokenizer: the joint tokenizer (already saved in the run folder by the caller).
        train_data: training pairs.
        valid_data: validation pairs (a subset of ``config.eval_sentences`` is used) or None.
        config: a :class:`TrainConfig`.
        run_dir: the run folder (must exist and hold config.json and tokenizer.json).
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        train_data: ParallelText,
        valid_data: ParallelText | None,
        config: TrainConfig,
        run_dir: str | Path,
    ) -> None:
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.run_dir = Path(run_dir)
        (self.run_dir / "checkpoints").mkdir(exist_ok=True)
        self.src_ids = tokenizer.encode_batch(train_data.src)
        self.tgt_ids = tokenizer.encode_batch(train_data.tgt)
        self.src_lengths = [len(s) + 1 for s in self.src_ids]
        self.tgt_lengths = [len(t) + 1 for t in self.tgt_ids]
        self.valid = valid_data
        self.optimizer = torch.optim.Adam(
            model.parameters(), lr=0.0, betas=config.adam_betas, eps=config.adam_eps
        )
        self.state = TrainState(kept_checkpoints=[])
        self.metrics_path = self.run_dir / "metrics.jsonl"

    # ----------------------------------------------------------------- state
    def save(self) -> None:
        """Save ``last.safetensors`` and ``state.pt`` (atomically), at an optimizer-step boundary."""
        ckpt.save_weights(self.model, self.run_dir / "last.safetensors")
        ckpt.save_training_state(
            self.run_dir / "state.pt",
            {
                "train_state": asdict(self.state),
                "optimizer": self.optimizer.state_dict(),
                "rng": _rng_state(),
            },
        )

    def resume(self) -> None:
        """Restore weights, optimizer, position and RNG from the run folder."""
        saved = ckpt.load_training_state(self.run_dir / "state.pt")
        ckpt.load_weights(self.model, self.run_dir / "last.safetensors")
        self.optimizer.load_state_dict(saved["optimizer"])
        _set_rng_state(saved["rng"] if "rng" in saved else {"cpu": saved["torch_rng"]})  # older runs: CPU only
        self.state = TrainState(**saved["train_state"])
        logger.info("resumed at step %d (epoch %d, %.1f minutes done)", self.state.step, self.state.epoch,
                    self.state.seconds / 60)

    def log(self, record: dict) -> None:
        """Append one JSON line to ``metrics.jsonl``."""
        with open(self.metrics_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")

    # ----------------------------------------------------------------- loop
    def _batches(self, epoch: int) -> list[list[int]]:
        return token_batches(self.src_lengths, self.tgt_lengths, self.config.max_tokens, seed=self.config.seed + epoch)

    def _done(self, epochs_float: float) -> bool:
        c, s = self.config, self.state
        return bool(
            s.stopped_early
            or (c.max_steps and s.step >= c.max_steps)
            or (c.max_minutes and s.seconds >= c.max_minutes * 60)
            or (c.max_epochs and epochs_float >= c.max_epochs)
        )

    def train(self) -> TrainState:
        """Run until a stop condition (steps, epochs, minutes). Ctrl-C saves a checkpoint and
        re-raises ``KeyboardInterrupt``. Returns the final :class:`TrainState`."""
        c, s, model = self.config, self.state, self.model
        if not (c.max_steps or c.max_minutes or c.max_epochs):
            raise ValueError("set at least one of max_steps, max_minutes, max_epochs")
        device = next(model.parameters()).device
        pad_id = model.config.pad_id
        batches = self._batches(s.epoch)
        # the fused projection + loss (qkv.loss); compiled, the encoder and decoder run as one graph
        loss_fn = torch.compile(model.loss, dynamic=True) if c.compile else model.loss
        session_start, session_seconds0 = time.perf_counter(), s.seconds
        window_tokens, window_loss, window_start = 0, 0.0, time.perf_counter()
        bar = tqdm(total=c.max_steps or None, initial=s.step, desc="training", unit="step", disable=not c.progress,
                   dynamic_ncols=True)
        try:
            while not self._done(s.epoch + s.batch_in_epoch / max(1, len(batches))):
                model.train()
                # where this step starts: restored if Ctrl-C lands inside it
                step_start = (s.epoch, s.batch_in_epoch, _rng_state(), s.step)
                group = []
                while len(group) < c.accum_steps:
                    if s.batch_in_epoch >= len(batches):
                        s.epoch, s.batch_in_epoch = s.epoch + 1, 0
                        batches = self._batches(s.epoch)
                    index = batches[s.batch_in_epoch]
                    s.batch_in_epoch += 1
                    group.append(make_batch([self.src_ids[i] for i in index], [self.tgt_ids[i] for i in index],
                                            pad_id=pad_id, bos_id=self.tokenizer.bos_id,
                                            eos_id=self.tokenizer.eos_id).to(device))
                group_tokens = sum(b.num_tgt_tokens for b in group)
                self.optimizer.zero_grad(set_to_none=True)
                loss_sum = 0.0
                for batch in group:
                    with autocast_context(device, c.bf16):
                        loss = loss_fn(batch.src, batch.tgt_in, batch.tgt_out, label_smoothing=c.label_smoothing)
                    (loss / group_tokens).backward()
                    loss_sum += float(loss.detach())
                if c.clip_norm > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), c.clip_norm)
                lr = inverse_sqrt_lr(s.step + 1, model.config.d_model, c.warmup_steps, c.lr_factor)
                for param_group in self.optimizer.param_groups:
                    param_group["lr"] = lr
                self.optimizer.step()
                s.step += 1
                s.tokens += group_tokens
                s.seconds = session_seconds0 + time.perf_counter() - session_start
                window_tokens += group_tokens
                window_loss += loss_sum
                bar.update(1)
                if s.step % c.log_every_steps == 0:
                    elapsed = time.perf_counter() - window_start
                    tps = window_tokens / max(elapsed, 1e-9)
                    record = {"event": "train", "step": s.step, "epoch": round(s.epoch + s.batch_in_epoch /
                              len(batches), 3), "minutes": round(s.seconds / 60, 3), "loss": round(
                              window_loss / window_tokens, 4), "lr": lr, "tokens_per_s": round(tps, 1)}
                    self.log(record)
                    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tps:.0f}", eta=self._eta())
                    window_tokens, window_loss, window_start = 0, 0.0, time.perf_counter()
                paused = time.perf_counter()
                self._maybe_evaluate_and_keep()
                window_start += time.perf_counter() - paused  # tokens/s counts training time only
        except KeyboardInterrupt:
            logger.warning("interrupted: saving a checkpoint at step %d before exiting", s.step)
            # a partly done step is dropped: the checkpoint sits on a step boundary, so resuming
            # replays exactly the batches and dropout masks of the interrupted step
            if "step_start" in locals() and s.step == step_start[3]:
                s.epoch, s.batch_in_epoch = step_start[0], step_start[1]
                _set_rng_state(step_start[2])
            self.save()
            bar.close()
            raise
        bar.close()
        self.save()
        return s

    def _eta(self) -> str:
        c, s = self.config, self.state
        remaining = []
        if c.max_minutes:
            remaining.append(c.max_minutes * 60 - s.seconds)
        if c.max_steps and s.step:
            remaining.append(s.seconds / s.step * (c.max_steps - s.step))
        if not remaining:
            return "?"
        secs = max(0, int(min(remaining)))
        return f"{secs // 60}:{secs % 60:02d}"

    def _maybe_evaluate_and_keep(self) -> None:
        c, s = self.config, self.state
        if (c.eval_every_steps and s.step % c.eval_every_steps == 0) or (
            c.eval_every_minutes and s.seconds - s.last_eval_seconds >= c.eval_every_minutes * 60
        ):
            s.last_eval_seconds = s.seconds
            self.evaluate()
        if (c.checkpoint_every_steps and s.step % c.checkpoint_every_steps == 0) or (
            c.checkpoint_every_minutes and s.seconds - s.last_checkpoint_seconds >= c.checkpoint_every_minutes * 60
        ):
            s.last_checkpoint_seconds = s.seconds
            self.keep_checkpoint()

    def keep_checkpoint(self) -> None:
        """Save ``checkpoints/step_<N>.safetensors`` (for averaging) and the resumable state."""
        path = self.run_dir / "checkpoints" / f"step_{self.state.step}.safetensors"
        ckpt.save_weights(self.model, path)
        kept = self.state.kept_checkpoints
        if path.name not in kept:
            kept.append(path.name)
        keep = max(self.config.average_last, 1)
        while len(kept) > keep:
            old = self.run_dir / "checkpoints" / kept.pop(0)
            if old.exists():
                old.unlink()
        self.save()

    @torch.no_grad()
    def evaluate(self) -> dict | None:
        """Validation loss and greedy BLEU on the first ``eval_sentences`` validation pairs;
        saves ``best.safetensors`` when BLEU improves."""
        if self.valid is None:
            return None
        c, s, model = self.config, self.state, self.model
        start = time.perf_counter()
        model.eval()
        n = min(c.eval_sentences, len(self.valid))
        src, refs = self.valid.src[:n], self.valid.tgt[:n]
        src_ids, tgt_ids = self.tokenizer.encode_batch(src), self.tokenizer.encode_batch(refs)
        pad_id = model.config.pad_id
        total_loss, total_tokens = 0.0, 0
        device = next(model.parameters()).device
        with autocast_context(device, c.bf16):
            for index in token_batches([len(x) + 1 for x in src_ids], [len(x) + 1 for x in tgt_ids], 4000, seed=None):
                batch = make_batch([src_ids[i] for i in index], [tgt_ids[i] for i in index], pad_id=pad_id,
                                   bos_id=self.tokenizer.bos_id, eos_id=self.tokenizer.eos_id).to(device)
                total_loss += float(model.loss(batch.src, batch.tgt_in, batch.tgt_out))
                total_tokens += batch.num_tgt_tokens
        hyps = translate_texts(model, self.tokenizer, src, beam_size=1, bf16=c.bf16)
        scores = score_translations(hyps, refs)
        accuracy = exact_match(hyps, refs)
        eval_seconds = time.perf_counter() - start
        val_loss = total_loss / total_tokens
        record = {"event": "valid", "step": s.step, "minutes": round(s.seconds / 60, 3),
                  "val_loss": round(val_loss, 4), "val_ppl": round(math.exp(val_loss), 3),
                  "val_bleu_greedy": scores["bleu"], "val_chrf_greedy": scores["chrf"],
                  "val_exact_match": round(accuracy, 4), "sentences": n, "eval_seconds": round(eval_seconds, 1)}
        self.log(record)
        logger.info("step %d (%.1f min): val loss %.3f, greedy BLEU %.2f, exact match %.1f%% on %d sentences",
                    s.step, s.seconds / 60, record["val_loss"], scores["bleu"], 100 * accuracy, n)
        if c.stop_at_exact_match and accuracy >= c.stop_at_exact_match:
            logger.info("validation exact match %.2f%% >= %.2f%%: stopping", 100 * accuracy,
                        100 * c.stop_at_exact_match)
            s.stopped_early = True
        if scores["bleu"] > s.best_bleu:
            s.best_bleu = scores["bleu"]
            ckpt.save_weights(model, self.run_dir / "best.safetensors")
        model.train()
        return record

    def finish(self) -> Path:
        """Write ``model.safetensors``: the average of the kept checkpoints (the final weights are
        added as one of them), or the final weights. Returns its path."""
        c = self.config
        out = self.run_dir / "model.safetensors"
        if c.average_last > 1:
            self.keep_checkpoint()
            paths = [self.run_dir / "checkpoints" / name for name in self.state.kept_checkpoints[-c.average_last:]]
            ckpt.average_weight_files(paths, out)
            logger.info("averaged %d checkpoints: %s", len(paths), ", ".join(p.name for p in paths))
        else:
            ckpt.save_weights(self.model, out)
        return out


def plot_metrics(metrics_path: str | Path, png_path: str | Path) -> None:
    """Draw training loss and validation BLEU against minutes into a PNG (atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("event") == "train"]
    valid = [r for r in records if r.get("event") == "valid"]
    fig, ax_loss = plt.subplots(figsize=(7, 4))
    ax_loss.plot([r["minutes"] for r in train], [r["loss"] for r in train], color="tab:blue", label="train loss")
    if valid:
        ax_loss.plot([r["minutes"] for r in valid], [r["val_loss"] for r in valid], "o-", color="tab:cyan",
                     label="val loss")
    ax_loss.set_xlabel("minutes")
    ax_loss.set_ylabel("loss (nats/token)")
    if valid:
        ax_bleu = ax_loss.twinx()
        ax_bleu.plot([r["minutes"] for r in valid], [r["val_bleu_greedy"] for r in valid], "s-", color="tab:red",
                     label="val BLEU (greedy)")
        ax_bleu.set_ylabel("BLEU")
        ax_bleu.legend(loc="center right")
    ax_loss.legend(loc="upper right")
    fig.tight_layout()
    with ckpt.atomic_path(png_path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------- runs
# Recipes: defaults for a model and its training, per data source. The Multi30k recipe is sized for
# an hour on a 2-core CPU (see benchmarks/train_multi30k.py); the date recipe for the demo's
# three minutes. Anything given explicitly overrides them.
RECIPES: dict[str, dict] = {
    "multi30k": {
        "vocab_size": 8000,
        "split_digits": False,
        "model": dict(d_model=256, num_heads=4, num_encoder_layers=3, num_decoder_layers=3, d_ff=1024, dropout=0.1,
                      max_len=256, share_embeddings=True, tie_output=True),
        # ~3.7k target tokens a step (124 steps an epoch): more updates than 6k-token batches in an hour
        # of CPU; warmup 400 with factor 0.7 reaches the same peak (2.2e-3) as warmup 800 with factor 1.
        # bf16 autocast only where it is fast (qkv.precision.bf16_is_fast); start_run turns it off elsewhere.
        "train": dict(max_tokens=4000, warmup_steps=400, lr_factor=0.7, bf16=True, max_minutes=60.0,
                      eval_every_minutes=6.0, checkpoint_every_minutes=3.0, average_last=5),
    },
    # Dates: 600 BPE tokens (enough that capitalised month and day names become whole tokens), digits
    # split; a 0.2M-parameter pre-LN model (pre-LN trains faster at this size than the paper's
    # post-LN); fresh dates never repeat enough to need dropout. About 1,000 steps reach 99.5%.
    "dates": {
        "vocab_size": 600,
        "split_digits": True,
        "model": dict(d_model=64, num_heads=4, num_encoder_layers=2, num_decoder_layers=2, d_ff=256, dropout=0.0,
                      max_len=64, norm_first=True, share_embeddings=True, tie_output=True),
        "train": dict(max_tokens=1500, warmup_steps=100, lr_factor=0.5, max_minutes=2.5, eval_every_steps=100,
                      eval_sentences=500, stop_at_exact_match=0.995, average_last=1),
    },
}
RECIPES["files"] = RECIPES["multi30k"]


def start_run(
    run_dir: str | Path,
    *,
    data: dict,
    model_options: dict | None = None,
    train_options: dict | None = None,
    vocab_size: int | None = None,
    overwrite: bool = False,
    device: str | torch.device = "cpu",
) -> Trainer:
    """Read the data, learn the tokenizer, create the run folder and return a ready :class:`Trainer`.

    Bad data raises before anything is written, and the run folder appears whole or not at all.

    Args:
        run_dir: the run folder to create.
        data: a data spec (:mod:`qkv.data.sources`), e.g. ``{"source": "multi30k", "src_lang": "en",
            "tgt_lang": "de"}``.
        model_options: :class:`TransformerConfig` fields over the source's recipe (vocabulary
            sizes and ``pad_id`` come from the tokenizer).
        train_options: :class:`TrainConfig` fields over the recipe.
        vocab_size: BPE vocabulary size (default: the recipe's).
        overwrite: replace an existing run folder.
        device: where the model trains.
    """
    check_spec(data)
    recipe = RECIPES[data["source"]]
    train_data, valid_data = load_train_valid(data)
    logger.info("data: %s, %d training pairs, %s validation pairs", describe(data), len(train_data),
                len(valid_data) if valid_data is not None else "no")
    tokenizer = Tokenizer.train(train_data.src + train_data.tgt, vocab_size=vocab_size or recipe["vocab_size"],
                                split_digits=recipe["split_digits"])
    model_config = TransformerConfig(**{
        **recipe["model"], **(model_options or {}),
        "src_vocab_size": tokenizer.vocab_size, "tgt_vocab_size": tokenizer.vocab_size, "pad_id": tokenizer.pad_id,
    })
    train_config = TrainConfig.from_dict({**recipe["train"], **(train_options or {})})
    if train_config.bf16 and not bf16_is_fast(device):
        if "bf16" in (train_options or {}):
            logger.warning("bf16 autocast asked for, but bfloat16 matrix products are slower than float32 "
                           "on this %s (no bf16 matrix instructions): expect slow steps", torch.device(device).type)
        else:  # the recipe's choice, made for hardware with bf16 units
            logger.info("bf16 autocast off: this %s has no fast bfloat16 matrix products", torch.device(device).type)
            train_config = replace(train_config, bf16=False)
    config = {"model": asdict(model_config), "train": asdict(train_config), "data": data}
    ckpt.create_run(run_dir, config, tokenizer, overwrite=overwrite)
    model = Transformer(model_config).to(device)
    logger.info("model: %.1fM parameters; run folder %s", sum(p.numel() for p in model.parameters()) / 1e6, run_dir)
    return Trainer(model, tokenizer, train_data, valid_data, train_config, run_dir)


def resume_run(run_dir: str | Path, *, train_options: dict | None = None,
               device: str | torch.device = "cpu") -> Trainer:
    """Reopen a run folder where it stopped (weights, optimizer, data position, RNG).

    Args:
        run_dir: a folder made by :func:`start_run`.
        train_options: :class:`TrainConfig` fields to change, e.g. a longer ``max_minutes``
            (saved back into config.json).
        device: where the model trains.
    """
    run_dir = Path(run_dir)
    config = ckpt.read_run_config(run_dir)
    if not (run_dir / "state.pt").is_file():
        raise FileNotFoundError(f"{run_dir / 'state.pt'}: no training state to resume from")
    train_data, valid_data = load_train_valid(config["data"])
    tokenizer = Tokenizer.load(run_dir / "tokenizer.json")
    model = Transformer(TransformerConfig.from_dict(config["model"])).to(device)
    train_config = TrainConfig.from_dict({**config["train"], **(train_options or {})})
    if train_options:
        ckpt.write_json(run_dir / "config.json", {**config, "train": asdict(train_config)})
    trainer = Trainer(model, tokenizer, train_data, valid_data, train_config, run_dir)
    trainer.resume()
    return trainer


def run_training(trainer: Trainer) -> Path:
    """Train until a stop condition, then write ``model.safetensors`` (averaged checkpoints) and
    ``curves.png``. On Ctrl-C the trainer saves a resumable checkpoint and ``KeyboardInterrupt``
    propagates. Returns the path of ``model.safetensors``."""
    try:
        trainer.train()
    finally:
        if trainer.metrics_path.is_file():
            plot_metrics(trainer.metrics_path, trainer.run_dir / "curves.png")
    return trainer.finish()
