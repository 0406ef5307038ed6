"""Training a translation Transformer: the paper's optimiser and schedule (section 5.3), label
smoothing (section 5.4), token-count batches, periodic validation, checkpoints, resume and
checkpoint averaging (section 6.1).

Seeds and thread counts are the caller's business (the CLI sets them); this module only saves and
restores the RNG state so that a resumed run continues exactly like an uninterrupted one. Run
folders (creating, recognising, resuming) live in :mod:`qkv.runs`; file formats in
:mod:`qkv.checkpoint`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from tqdm.auto import tqdm

from qkv import checkpoint as ckpt
from qkv.data.batching import make_batch, token_batches
from qkv.data.parallel import ParallelText
from qkv.data.tokenizer import Tokenizer
from qkv.evaluation import exact_match, score_translations, translate_texts
from qkv.models import Transformer
from qkv.precision import autocast_context

logger = logging.getLogger(__name__)


def _option(default, help: str, *, flag: str | None = None, minimum: float | None = None,
            below: float | None = None, maximum: float | None = None, cli: bool = True):
    """A :class:`TrainConfig` field with everything the CLI and the checks need, declared once:
    its help, its flag (default ``--field-name``) and its allowed range."""
    meta = {"help": help, "flag": flag, "minimum": minimum, "below": below, "maximum": maximum, "cli": cli}
    if isinstance(default, tuple):
        return field(default_factory=lambda: default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    """Options of a training run (saved in the run's config.json). Each field's metadata holds its
    command-line help and allowed range: ``qkv train``'s flags are made from these fields."""

    max_tokens: int = _option(6000, "padded tokens per batch (sentences x longest source or target)", minimum=1)
    accum_steps: int = _option(1, "batches whose gradients are summed into one optimizer step", minimum=1)
    lr_factor: float = _option(1.0, "multiplies the paper's schedule d_model^-0.5 * min(step^-0.5, "
                                    "step * warmup^-1.5)", minimum=0, below=math.inf)
    warmup_steps: int = _option(800, "linear warmup steps of the inverse-sqrt schedule (the paper: 4000)",
                                flag="--warmup", minimum=1)
    adam_betas: tuple[float, float] = _option((0.9, 0.98), "Adam's beta1 and beta2 (section 5.3)", cli=False)
    adam_eps: float = _option(1e-9, "Adam's epsilon", minimum=0, below=math.inf, cli=False)
    label_smoothing: float = _option(0.1, "label smoothing epsilon (section 5.4)", minimum=0, below=1)
    clip_norm: float = _option(1.0, "gradient clipping on the global norm (0 = off)", minimum=0, below=math.inf)
    bf16: bool = _option(False, "bfloat16 autocast (weights and the optimizer stay float32); the Multi30k recipe "
                                "turns it on where bf16 matrix products are fast (CUDA, CPUs with AVX512-BF16/AMX)")
    compile: bool = _option(False, "torch.compile the encoder and decoder (the fused loss stays eager); on a "
                                   "2-core CPU it made the step slower, see the README")
    max_steps: int = _option(0, "stop after this many optimizer steps (0 = no limit)", minimum=0)
    max_epochs: float = _option(0.0, "stop after this many passes over the data (0 = no limit)", flag="--epochs",
                                minimum=0, below=math.inf)
    max_minutes: float = _option(0.0, "stop after this much wall time over all sessions, validation included "
                                      "(0 = no limit)", flag="--minutes", minimum=0, below=math.inf)
    eval_every_steps: int = _option(0, "validate every N steps (0 = off)", minimum=0)
    eval_every_minutes: float = _option(0.0, "validate every N minutes (0 = off)", minimum=0, below=math.inf)
    eval_sentences: int = _option(300, "validation sentences decoded greedily for BLEU", minimum=1)
    stop_at_exact_match: float = _option(0.0, "stop once validation exact match reaches this fraction (0 = off)",
                                         minimum=0, maximum=1, cli=False)
    checkpoint_every_steps: int = _option(0, "keep a checkpoint for averaging every N steps (0 = off)", minimum=0)
    checkpoint_every_minutes: float = _option(0.0, "... or every N minutes (0 = off)", minimum=0, below=math.inf)
    average_last: int = _option(5, "average this many kept checkpoints at the end (<= 1: no averaging)", minimum=0)
    log_every_steps: int = _option(20, "write a training-loss line to metrics.jsonl every N steps", minimum=1)
    seed: int = _option(0, "drives the initial weights and the batch order", minimum=0)
    progress: bool = _option(True, "tqdm progress bar", cli=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            name = f"{f.name} ({meta['flag'] or '--' + f.name.replace('_', '-')})" if meta.get("cli") else f.name
            if f.type == "bool":
                if not isinstance(value, bool):
                    raise ValueError(f"{name} must be true or false, got {value!r}")
                continue
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if f.type == "float":
                if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
                    raise ValueError(f"{name} must be a number, got {value!r}")
                setattr(self, f.name, float(value))
                value = float(value)
            if f.type.startswith("tuple"):
                if not (isinstance(value, (tuple, list)) and len(value) == 2
                        and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in value)):
                    raise ValueError(f"{name} must be two numbers in [0, 1), got {value!r}")
                setattr(self, f.name, tuple(float(b) for b in value))
                continue
            low, below, high = meta.get("minimum"), meta.get("below"), meta.get("maximum")
            if (low is not None and value < low) or (below is not None and value >= below) or (
                    high is not None and value > high):
                allowed = f">= {low}" if low is not None else ""
                if below is not None and below != math.inf:
                    allowed += f" and < {below}"
                elif below == math.inf:
                    allowed += " and finite"
                if high is not None:
                    allowed += f" and <= {high}"
                raise ValueError(f"{name} must be {allowed.strip()}, got {value!r}")

    def check_stops(self) -> None:
        """A run needs a stop condition; raises ``ValueError`` naming the options otherwise."""
        if not (self.max_steps or self.max_minutes or self.max_epochs):
            raise ValueError("set at least one stop condition: max_steps (--max-steps), max_minutes (--minutes) "
                             "or max_epochs (--epochs), each > 0")

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        """Build from a dict (e.g. config.json's ``train``); unknown keys or bad values raise ``ValueError``."""
        if not isinstance(data, dict):
            raise ValueError(f"training options must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TrainConfig fields: {unknown}")
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
    """Where a run stands; saved in state.pt with the weights, the optimizer and the RNG states."""

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
    metrics_bytes: int = 0  # length of metrics.jsonl at this step (lines after it are cut on resume)


class TrainingCrashed(RuntimeError):
    """A training step failed; the last whole step was saved. ``step`` is where to resume from."""

    def __init__(self, step: int, cause: BaseException) -> None:
        first_line = (str(cause).strip().splitlines() or [""])[0]
        super().__init__(f"training failed after step {step} ({type(cause).__name__}: {first_line[:300]})")
        self.step = step


def encode_pairs(tokenizer: Tokenizer, data: ParallelText, max_len: int, *, what: str = "training"
                 ) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Tokenise ``data`` and drop the pairs that do not fit a model of ``max_len`` positions
    (source + EOS, or BOS + target, longer than ``max_len``), logging how many and the first
    one's file and line, so an over-long line never surfaces as a crash in the middle of a run.

    Returns:
        ``(source ids, target ids, kept indices into data)``.
    """
    src_all, tgt_all = tokenizer.encode_batch(data.src), tokenizer.encode_batch(data.tgt)
    kept = [i for i, (s, t) in enumerate(zip(src_all, tgt_all)) if len(s) + 1 <= max_len and len(t) + 1 <= max_len]
    dropped = len(src_all) - len(kept)
    if dropped:
        first = next(i for i, (s, t) in enumerate(zip(src_all, tgt_all)) if len(s) + 1 > max_len
                     or len(t) + 1 > max_len)
        where = f"{data.src_path or 'source'}:{first + 1} / {data.tgt_path or 'target'}:{first + 1}"
        logger.warning("dropped %d of %d %s pairs longer than the model's %d positions (first: %s, %d and %d "
                       "tokens); pass a larger --max-len to keep them", dropped, len(src_all), what, max_len, where,
                       len(src_all[first]), len(tgt_all[first]))
    return [src_all[i] for i in kept], [tgt_all[i] for i in kept], kept


class Trainer:
    """Trains ``model`` on tokenised parallel text and writes into ``run_dir``.

    Building a Trainer writes nothing; files are written by :meth:`save`, :meth:`log` and the
    loop. Training pairs longer than the model's ``max_len`` are dropped here (see
    :func:`encode_pairs`).

    Args:
        model: the :class:`Transformer` to train (its config sizes the schedule).
        tokenizer: the joint tokenizer (already saved in the run folder by the caller).
        train_data: training pairs.
        valid_data: validation pairs (a subset of ``config.eval_sentences`` is used) or None.
        config: a :class:`TrainConfig`.
        run_dir: the run folder (holds config.json and tokenizer.json once the run is created).

    Raises:
        ValueError: no training pair fits the model.
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
        self.src_ids, self.tgt_ids, _ = encode_pairs(tokenizer, train_data, model.config.max_len)
        if not self.src_ids:
            raise ValueError(f"none of the {len(train_data)} training pairs fits the model's {model.config.max_len} "
                             "positions; pass a larger --max-len")
        self.src_lengths = [len(s) + 1 for s in self.src_ids]
        self.tgt_lengths = [len(t) + 1 for t in self.tgt_ids]
        self.valid = valid_data
        self.optimizer = torch.optim.Adam(
            model.parameters(), lr=0.0, betas=config.adam_betas, eps=config.adam_eps
        )
        self.state = TrainState(kept_checkpoints=[])
        self.metrics_path = self.run_dir / "metrics.jsonl"

    # ----------------------------------------------------------------- state
    def save(self, folder: str | Path | None = None) -> None:
        """Save the resumable checkpoint (one atomic unit: weights, optimizer, position, RNG) and
        ``last.safetensors``, at an optimizer-step boundary, into ``folder`` (default: the run's)."""
        folder = Path(folder) if folder is not None else self.run_dir
        metrics = folder / self.metrics_path.name
        self.state.metrics_bytes = metrics.stat().st_size if metrics.is_file() else 0
        ckpt.save_checkpoint(folder, self.model, {
            "train_state": asdict(self.state),
            "optimizer": self.optimizer.state_dict(),
            "rng": _rng_state(),
        })

    def resume(self) -> None:
        """Restore weights, optimizer, position and RNG from the run folder, cut ``metrics.jsonl``
        back to what it held at that step, and clear what a killed process left behind."""
        saved = ckpt.load_checkpoint(self.run_dir, self.model)
        self.optimizer.load_state_dict(saved["optimizer"])
        _set_rng_state(saved["rng"] if "rng" in saved else {"cpu": saved["torch_rng"]})  # older runs: CPU only
        self.state = TrainState(**saved["train_state"])
        self.state.kept_checkpoints = self.state.kept_checkpoints or []
        written_by_this_format = "metrics_bytes" in saved["train_state"]
        if written_by_this_format and self.metrics_path.is_file() and (
                self.metrics_path.stat().st_size > self.state.metrics_bytes):
            with open(self.metrics_path, "r+b") as handle:  # lines logged after the saved step are replayed
                handle.truncate(self.state.metrics_bytes)
        self._remove_unkept_checkpoints()
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
        re-raises ``KeyboardInterrupt``; any other failure inside a step saves the last whole step
        and raises :class:`TrainingCrashed`. Returns the final :class:`TrainState`."""
        c, s, model = self.config, self.state, self.model
        c.check_stops()
        device = next(model.parameters()).device
        pad_id = model.config.pad_id
        batches = self._batches(s.epoch)
        # the fused projection + loss (qkv.loss); compiled, the encoder and decoder run as one graph
        loss_fn = torch.compile(model.loss, dynamic=True) if c.compile else model.loss
        session_start, session_seconds0 = time.perf_counter(), s.seconds
        window_tokens, window_loss, window_start = 0, 0.0, time.perf_counter()
        bar = tqdm(total=c.max_steps or None, initial=s.step, desc="training", unit="step", disable=not c.progress,
                   dynamic_ncols=True)
        step_start = None
        try:
            while not self._done(s.epoch + s.batch_in_epoch / max(1, len(batches))):
                model.train()
                # where this step starts: restored if the step does not finish
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
                if not math.isfinite(loss_sum):
                    raise FloatingPointError(f"the loss is {loss_sum} at step {s.step + 1}; lower --lr-factor or "
                                             "check the data")
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
        except (KeyboardInterrupt, Exception) as err:
            bar.close()
            self._save_after_failure(step_start)
            if isinstance(err, KeyboardInterrupt):
                raise
            raise TrainingCrashed(s.step, err) from err
        bar.close()
        self.save()
        return s

    def _save_after_failure(self, step_start: tuple | None) -> None:
        """Save the last whole step after Ctrl-C or a failure inside the loop. A partly done step
        is dropped (its batches and dropout masks are replayed on resume); when the step itself
        had finished (the failure came while validating or saving), the state is already whole."""
        s = self.state
        logger.warning("stopping: saving a checkpoint at step %d", s.step)
        if step_start is not None and s.step == step_start[3]:
            s.epoch, s.batch_in_epoch = step_start[0], step_start[1]
            _set_rng_state(step_start[2])
        try:
            self.save()
        except Exception as save_err:  # e.g. a full disk: the previous checkpoint is still whole
            logger.error("could not save the checkpoint (%s); the previous one is kept", save_err)

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
        """Save ``checkpoints/step_<N>.safetensors`` (for averaging) and the resumable state.

        Order matters for a crash at any point: the new file is written, then the state that lists
        it, and only then are files the state no longer lists removed."""
        folder = self.run_dir / "checkpoints"
        path = folder / f"step_{self.state.step}.safetensors"
        ckpt.save_weights(self.model, path)
        kept = self.state.kept_checkpoints
        if path.name not in kept:
            kept.append(path.name)
        del kept[: max(0, len(kept) - max(self.config.average_last, 1))]
        self.save()
        self._remove_unkept_checkpoints()

    def _remove_unkept_checkpoints(self) -> None:
        folder = self.run_dir / "checkpoints"
        if folder.is_dir():
            for path in folder.glob("step_*.safetensors"):
                if path.name not in self.state.kept_checkpoints:
                    path.unlink(missing_ok=True)

    @torch.no_grad()
    def evaluate(self) -> dict | None:
        """Validation loss and greedy BLEU on the first ``eval_sentences`` validation pairs (those
        that fit the model); saves ``best.safetensors`` when BLEU improves."""
        if self.valid is None:
            return None
        c, s, model = self.config, self.state, self.model
        start = time.perf_counter()
        model.eval()
        subset = ParallelText(self.valid.src[: c.eval_sentences], self.valid.tgt[: c.eval_sentences],
                              self.valid.src_path, self.valid.tgt_path)
        src_ids, tgt_ids, kept = encode_pairs(self.tokenizer, subset, model.config.max_len, what="validation")
        if not kept:
            logger.warning("no validation pair fits the model's %d positions: validation skipped", model.config.max_len)
            model.train()
            return None
        src, refs = [subset.src[i] for i in kept], [subset.tgt[i] for i in kept]
        n = len(kept)
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
                  "val_loss": round(val_loss, 4), "val_ppl": round(math.exp(min(val_loss, 700)), 3),
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
