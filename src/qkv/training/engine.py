"""The training engine: one :class:`Trainer` for every task, on one process or many.

:meth:`Trainer.step` is the training step (forward, backward, clipping, schedule, optimizer) that
the loop, ``qkv bench training`` and the tests call. :meth:`Trainer.train` is the loop: every
process builds the same batches from the shared seed and takes its share of each step's group;
rank 0 logs, validates and writes the run folder, the others wait for it. The loss is a sum over
target tokens divided by the number of target tokens of the whole step over all processes, so N
processes with batch B train like one process with batch N*B (section 5.3's optimiser, 5.4's label
smoothing, 6.1's checkpoint averaging). What a step minimises is its training objective
(:mod:`qkv.training.objectives`: label-smoothed cross-entropy by default). The Trainer owns its parts:
``checkpoints`` (:class:`~qkv.training.checkpointing.Checkpoints`: save, resume, keep, average),
``hooks`` (:class:`~qkv.training.hooks.StepHooks`: the research methods of :mod:`qkv.training.methods`,
called at four points and nowhere else, so the step and the loop carry no method-specific code),
``throughput`` and ``optimizer``.

Seeds and thread counts are the caller's business (the CLI sets them); the engine saves and
restores every process's RNG state, so a resumed run continues exactly like an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from tqdm.auto import tqdm

from qkv.data.batching import Batch
from qkv.runtime.heap import HeapTrimmer, resident_memory_bytes, trim_heap
from qkv.runtime.precision import autocast_context
from qkv.training import checkpoint_files as ckpt
from qkv.training.checkpointing import Checkpoints
from qkv.training.config import TrainConfig, TrainState
from qkv.training.distributed import Distributed, gradient_sync, plain_copy, wrap
from qkv.training.methods import step_hooks
from qkv.training.objectives import DEFAULT_OBJECTIVE, make_objective
from qkv.training.optimizer import LR_SCALE, make_optimizer
from qkv.training.schedule import budget_progress, budget_spent, learning_rate, stop_reason, time_left
from qkv.training.signals import signals_held
from qkv.training.task import Task
from qkv.training.throughput import Throughput

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    """What one optimizer step did, over all processes."""

    loss: float  # summed loss over the step's target tokens
    tokens: int  # target tokens in the step
    lr: float  # the learning rate used
    grad_norm: float  # global gradient norm before clipping


class TrainingCrashed(RuntimeError):
    """A training step failed; the last whole step was saved. ``step`` is where to resume from."""

    def __init__(self, step: int, cause: BaseException) -> None:
        first_line = (str(cause).strip().splitlines() or [""])[0]
        super().__init__(f"training failed after step {step} ({type(cause).__name__}: {first_line[:300]})")
        self.step = step


class Trainer:
    """Trains ``model`` on ``task`` and writes into ``run_dir``; building it writes nothing.

    Args:
        model: the model (its ``config.d_model`` sizes the schedule), on its device.
        task: batches, loss and validation (a :class:`~qkv.training.task.Task`, e.g.
            :class:`~qkv.training.tasks.TranslationTask`).
        config: a :class:`TrainConfig`.
        run_dir: the run folder (holds config.json and tokenizer.json once the run is created).
        dist: this process's place among several (:func:`~qkv.training.distributed.init_distributed`; alone).
        d_model: the width the learning-rate schedule is scaled by (default ``model.config.d_model``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        task: Task,
        config: TrainConfig,
        run_dir: str | Path | None = None,
        *,
        dist: Distributed | None = None,
        d_model: int | None = None,
    ) -> None:
        self.model, self.task, self.config = model, task, config
        model_config: Any = getattr(model, "config", None)
        self.d_model: int = d_model or model_config.d_model
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.device = next(model.parameters()).device
        self.dist = dist or Distributed(device=self.device)
        self.sharded = self.dist.enabled and config.strategy == "fsdp"
        shadow = plain_copy(model) if self.sharded and self.dist.is_main else None  # rank 0's whole model
        self.module = wrap(model, task.loss_fn, self.dist, config.strategy)
        self._call = torch.compile(self.module, dynamic=True) if config.compile else self.module
        self.optimizer = make_optimizer(self.module, config, fused=not self.sharded or None, d_model=self.d_model)
        if config.ema_decay and self.sharded:
            raise ValueError("--ema-decay is not supported with --strategy fsdp (the average would be sharded too)")
        # the moving average of the weights (PyTorch's AveragedModel: a float32 copy, updated with foreach ops)
        self.ema = (
            AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(config.ema_decay)) if config.ema_decay else None
        )
        self.hooks = step_hooks(model, task, config)  # the research methods (and the task's subword dropout)
        self.objective = make_objective(DEFAULT_OBJECTIVE, label_smoothing=config.label_smoothing)
        self.state = TrainState(kept_checkpoints=[])
        self.progress = 0.0  # share of the budget spent, set before each step by the loop (see _done)
        self.checkpoints = Checkpoints(
            run_dir=self.run_dir,
            model=model,
            optimizer=self.optimizer,
            dist=self.dist,
            sharded=self.sharded,
            shadow=shadow,  # copied before wrap: FSDP2 shards the model in place
            ema=self.ema,
            average_last=config.average_last,
            seed=config.seed,
        )
        # the current epoch's batches, built once
        self._batches_epoch: int | None = None
        self._batches_cache: Sequence[list[int]] = []
        self.metrics_path = self.run_dir / "metrics.jsonl" if self.run_dir is not None else None
        self.throughput = Throughput(model, self.device, config.bf16, self.dist.world_size)  # FLOPs, MFU, padding

    # ----------------------------------------------------------------- the step
    def step(self, batches: list[Batch]) -> StepStats:
        """One optimizer step over this process's ``batches`` (micro-batches whose gradients are
        summed). A batch with ``num_tgt_tokens == 0`` is a zero-weight stand-in: it runs forward and
        backward (so every process joins the same collectives) but changes nothing."""
        c, s = self.config, self.state
        local_tokens = sum(b.num_tgt_tokens for b in batches)
        # progress: rank 0's, the same everywhere; a research method may replace the objective (--rdrop)
        objective = self.hooks.objective(self.objective, self.progress)
        (tokens, *work) = self.dist.all_reduce_sum([local_tokens, *self.throughput.work(batches, objective.copies)])
        if tokens <= 0:
            raise ValueError("a training step needs at least one target token")
        # DDP and FSDP average gradients over processes: divide by the tokens per process instead
        per_process = tokens / self.dist.world_size
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        with self.hooks.around_step(self, s.step + 1):  # e.g. --dropout-start holds dropout off
            for i, batch in enumerate(batches):
                batch = batch.to(self.device)
                with gradient_sync(self.module, enabled=i == len(batches) - 1):
                    with autocast_context(self.device, c.bf16):
                        loss = self.task.loss(self._call, batch, objective)
                    (loss / per_process if batch.num_tgt_tokens else loss * 0.0).backward()
                if batch.num_tgt_tokens:
                    loss_sum += float(loss.detach())
        (loss_sum,) = self.dist.all_reduce_sum([loss_sum])
        if not math.isfinite(loss_sum):
            raise FloatingPointError(
                f"the loss is {loss_sum} at step {s.step + 1}; lower --lr-factor or check the data"
            )
        params = [p for p in self.module.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, c.clip_norm if c.clip_norm > 0 else math.inf)
        lr = learning_rate(c, s.step + 1, self.d_model, self.progress)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get(LR_SCALE, 1.0)  # Muon's groups: its own base rate (--muon-lr)
        with signals_held():  # Ctrl-C or SIGTERM here would leave half-updated weights for the checkpoint
            self.optimizer.step()
            if self.ema is not None:
                self.ema.update_parameters(self.model)
            s.step, s.tokens = s.step + 1, s.tokens + int(tokens)
        self.throughput.add(work)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2: a DTensor
        return StepStats(loss=loss_sum, tokens=int(tokens), lr=lr, grad_norm=float(grad_norm))

    # ----------------------------------------------------------------- the loop
    def _epoch_batches(self, epoch: int) -> Sequence[list[int]]:
        if self._batches_epoch != epoch:
            self._batches_epoch, self._batches_cache = (
                epoch,
                self.task.batches(epoch, self.config.max_tokens, self.config.seed),
            )
        return self._batches_cache

    def _next_group(self) -> list[Batch]:
        """This process's share of the next step: the step takes ``accum_steps x world_size``
        batches of the epoch (never crossing into the next), process r the r-th run of
        ``accum_steps``. Where the epoch ends first, a process tops up with zero-weight batches."""
        s, c, d = self.state, self.config, self.dist
        batches = self._epoch_batches(s.epoch)
        if s.batch_in_epoch >= len(batches):
            s.epoch, s.batch_in_epoch = s.epoch + 1, 0
            self.hooks.epoch_started(self)  # e.g. --both-directions-until drops the reversed pairs
            batches = self._epoch_batches(s.epoch)
        group = batches[s.batch_in_epoch : s.batch_in_epoch + c.accum_steps * d.world_size]
        s.batch_in_epoch += len(group)
        mine = [
            self.task.make_batch(ix, s.epoch) for ix in group[d.rank * c.accum_steps : (d.rank + 1) * c.accum_steps]
        ]
        if d.enabled:  # the same number of forward passes everywhere (FSDP gathers weights in each)
            stand_in = mine[0] if mine else self.task.make_batch(group[0], s.epoch)
            mine += [replace(stand_in, num_tgt_tokens=0)] * (c.accum_steps - len(mine))
        return mine

    def _done(self) -> bool:
        c, s, epochs = self.config, self.state, self._epochs()
        done = budget_spent(c, s, epochs)
        progress = budget_progress(c, step=s.step, seconds=s.seconds, epochs=epochs)
        # rank 0's clock decides for everyone: when to stop, and the budget schedule's rate (equal on every replica)
        done, self.progress = self.dist.broadcast((done, progress))
        return done

    def train(self) -> TrainState:
        """Run until a stop condition (steps, epochs, minutes). Ctrl-C saves a checkpoint and
        re-raises ``KeyboardInterrupt``; any other failure inside a step saves the last whole step
        and raises :class:`TrainingCrashed`. Returns the final :class:`TrainState`."""
        c, s = self.config, self.state
        c.check_stops()
        session_start, session_seconds0 = time.perf_counter(), s.seconds
        window_tokens, window_loss, window_start = 0, 0.0, time.perf_counter()
        bar = tqdm(
            total=c.max_steps or None,
            initial=s.step,
            desc="training",
            unit="step",
            dynamic_ncols=True,
            disable=not (c.progress and self.dist.is_main),
        )
        step_start = None
        if self.dist.is_main and (hint := self.throughput.hint(None)):  # a machine already busy with other work
            logger.warning(hint)
        # every batch has another shape: give the heap's freed holes back to the OS now and then,
        # so resident memory stays flat over hours (qkv.runtime.heap; ~0.15 s every 50 steps)
        trimmer = HeapTrimmer(every_steps=50)
        try:
            while not self._done():
                self.module.train()
                step_start = (s.epoch, s.batch_in_epoch, ckpt.rng_state(), s.step)  # restored if the step fails
                stats = self.step(self._next_group())
                s.seconds = session_seconds0 + time.perf_counter() - session_start
                window_tokens += stats.tokens
                window_loss += stats.loss
                trimmer.step(s.step)
                bar.update(1)
                if s.step % c.log_every_steps == 0:
                    elapsed = max(time.perf_counter() - window_start, 1e-9)
                    tps = window_tokens / elapsed
                    epoch = s.epoch + s.batch_in_epoch / len(self._epoch_batches(s.epoch))
                    record = {
                        "event": "train",
                        "step": s.step,
                        "epoch": round(epoch, 3),
                        "minutes": round(s.seconds / 60, 3),
                        "loss": round(window_loss / window_tokens, 4),
                        "lr": stats.lr,
                        "tokens_per_s": round(tps, 1),
                        **self.throughput.window(elapsed),  # tflops_per_s, mfu, padding
                    }
                    rss = resident_memory_bytes()
                    if rss is not None:
                        record["rss_mb"] = round(rss / 2**20, 1)
                    self.log(record)
                    if self.dist.is_main and (hint := self.throughput.hint(record)):  # far below the measured peak
                        logger.warning(hint)
                    bar.set_postfix(
                        loss=f"{record['loss']:.3f}",
                        tok_s=f"{tps:.0f}",
                        **Throughput.postfix(record),
                        eta=time_left(self.config, self.state),
                    )
                    window_tokens, window_loss, window_start = 0, 0.0, time.perf_counter()
                paused = time.perf_counter()
                self._maybe_evaluate_and_keep()
                window_start += time.perf_counter() - paused  # tokens/s counts training time only
        except (KeyboardInterrupt, Exception) as err:
            bar.close()
            self.checkpoints.save_after_failure(s, step_start)
            if isinstance(err, KeyboardInterrupt):
                raise
            raise TrainingCrashed(s.step, err) from err
        bar.close()
        if (c.eval_every_steps or c.eval_every_minutes) and s.last_eval_step != s.step:
            self._maybe_evaluate_and_keep(final=True)  # the budget's end is validated too
        self.save()
        return s

    def stopped_by(self) -> str:
        """What ended the last :meth:`train` that returned, in words for the run's final line (see
        :func:`~qkv.training.schedule.stop_reason`)."""
        return stop_reason(self.config, self.state, self._epochs())

    def _epochs(self) -> float:
        s = self.state
        return s.epoch + s.batch_in_epoch / max(1, len(self._epoch_batches(s.epoch)))

    def _maybe_evaluate_and_keep(self, *, final: bool = False) -> None:
        c, s = self.config, self.state
        evaluate = bool(
            final
            or (c.eval_every_steps and s.step % c.eval_every_steps == 0)
            or (c.eval_every_minutes and s.seconds - s.last_eval_seconds >= c.eval_every_minutes * 60)
        )
        keep = bool(
            (c.checkpoint_every_steps and s.step % c.checkpoint_every_steps == 0)
            or (c.checkpoint_every_minutes and s.seconds - s.last_checkpoint_seconds >= c.checkpoint_every_minutes * 60)
        )
        evaluate, keep = self.dist.broadcast((evaluate, keep))
        if evaluate:
            s.last_eval_seconds, s.last_eval_step = s.seconds, s.step
            self.evaluate()
            trim_heap()  # decoding made tensors of many new shapes
        if keep:
            s.last_checkpoint_seconds = s.seconds
            self.keep_checkpoint()

    # ----------------------------------------------------------------- weights and files (rank 0 writes)
    @property
    def run_folder(self) -> Path:
        """The run folder, for a Trainer built with one (raises ``ValueError`` for one built without)."""
        return self.checkpoints.run_folder

    def plain_model(self) -> torch.nn.Module | None:
        """The whole model as one module, to validate and save with: the model itself, or under
        FSDP2 rank 0's unsharded copy refreshed from the shards (a collective: every process calls
        it; the others get None)."""
        return self.checkpoints.plain_model()

    def save(self, folder: str | Path | None = None) -> None:
        """Save the resumable checkpoint (one atomic file: weights, optimizer, position, every
        process's RNG) and ``last.safetensors`` into ``folder`` (default: the run's); every process
        calls it, rank 0 writes (:meth:`Checkpoints.save <qkv.training.checkpointing.Checkpoints.save>`)."""
        self.checkpoints.save(self.state, folder)

    def resume(self, *, trust: bool = False) -> None:
        """Restore weights, optimizer, position and RNG from the run folder and redo what the saved
        state says the research methods did (:meth:`Checkpoints.resume
        <qkv.training.checkpointing.Checkpoints.resume>`; ``trust``: see
        :func:`qkv.training.checkpoint_files.load_checkpoint`)."""
        self.state = self.checkpoints.resume(trust=trust)
        self.hooks.resumed(self)

    def keep_checkpoint(self) -> None:
        """Save ``checkpoints/step_<N>.safetensors`` (for averaging) and the resumable state."""
        self.checkpoints.keep(self.state)

    def forget_batches(self) -> None:
        """Drop the batches built for the current epoch (the task's data changed): the next use rebuilds them."""
        self._batches_epoch = None

    def log(self, record: dict) -> None:
        """Append one JSON line to ``metrics.jsonl`` (rank 0)."""
        if self.dist.is_main and self.metrics_path is not None:
            with open(self.metrics_path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")

    def evaluate(self) -> dict | None:
        """Validate on rank 0 (the others wait); save ``best.safetensors`` when the task's score
        improves; stop once ``stop_at_exact_match`` is reached."""
        c, s = self.config, self.state
        model = self.plain_model()
        record = None
        if self.dist.is_main:
            assert model is not None  # rank 0 holds the whole model
            start = time.perf_counter()
            model.eval()
            figures = self.task.validate(model, c.eval_sentences, c.bf16)
            model.train()
            if figures is not None:
                score = figures.pop("score")
                record = {
                    "event": "valid",
                    "step": s.step,
                    "minutes": round(s.seconds / 60, 3),
                    **figures,
                    "eval_seconds": round(time.perf_counter() - start, 1),
                }
                self.log(record)
                logger.info(
                    "step %d (%.1f min): %s", s.step, s.seconds / 60, ", ".join(f"{k} {v}" for k, v in figures.items())
                )
                accuracy = figures.get("val_exact_match", 0.0)
                if c.stop_at_exact_match and accuracy >= c.stop_at_exact_match:
                    logger.info(
                        "validation exact match %.2f%% >= %.2f%%: stopping", 100 * accuracy, 100 * c.stop_at_exact_match
                    )
                    s.stopped_early = True
                if score > s.best_score:
                    s.best_score = score
                    ckpt.save_weights(model, self.run_folder / "best.safetensors")
        s.stopped_early, s.best_score = self.dist.broadcast((s.stopped_early, s.best_score))
        return record

    def finish(self) -> Path:
        """Write ``model.safetensors`` and return its path: with ``final_weights="best"`` the best validation's
        weights (once one ran), with ``"ema"`` the moving average, else the kept checkpoints averaged (the final
        weights among them), or the final ones. A run with ``ema_decay`` also writes ``ema.safetensors``
        (:meth:`Checkpoints.finish <qkv.training.checkpointing.Checkpoints.finish>`)."""
        return self.checkpoints.finish(self.state, self.config.final_weights)
