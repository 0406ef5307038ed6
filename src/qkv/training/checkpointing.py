"""The run folder's checkpoints, for :class:`~qkv.training.engine.Trainer`: the resumable state
(:meth:`~Checkpointing.save`, :meth:`~Checkpointing.resume`), the last whole step saved after Ctrl-C,
SIGTERM or a failed step, and the checkpoints kept for averaging. Every write goes through
:mod:`qkv.training.checkpoint_files` (atomic files, written in an order that a crash at any point leaves consistent)."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from dataclasses import asdict
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from qkv.training import checkpoint_files as ckpt
from qkv.training.config import TrainConfig, TrainState
from qkv.training.distributed import (
    Distributed,
    full_state,
    load_full_state,
    load_optimizer_shards,
    remove_optimizer_shards,
    save_optimizer_shards,
)

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def sigterm_held() -> Iterator[None]:
    """SIGTERM waits while the block runs (in the main thread): a save after a failure finishes, then
    the signal is delivered as it arrived. SIGKILL still ends the process at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if pending:
            signal.raise_signal(signal.SIGTERM)


class Checkpointing:
    """The checkpoint half of :class:`~qkv.training.engine.Trainer`, which sets the attributes declared
    here and defines :meth:`plain_model`."""

    model: nn.Module
    task: Any  # a training task (qkv.training.tasks)
    optimizer: torch.optim.Optimizer
    ema: AveragedModel | None
    config: TrainConfig
    state: TrainState
    dist: Distributed
    sharded: bool  # FSDP2: each process holds a shard of the weights
    run_dir: Path | None
    metrics_path: Path | None
    _shadow: nn.Module | None  # under FSDP2, rank 0's unsharded copy
    _batches_epoch: int | None

    def plain_model(self) -> nn.Module | None:
        """The whole model (None on the processes other than rank 0 under FSDP2)."""
        raise NotImplementedError

    @property
    def run_folder(self) -> Path:
        """The run folder, for a Trainer built with one."""
        if self.run_dir is None:
            raise ValueError("this Trainer was built without a run folder (run_dir=None): it cannot save or resume")
        return self.run_dir

    def _whole_model(self) -> nn.Module:
        """Rank 0's whole model: the model, or under FSDP2 its unsharded copy."""
        model = self._shadow if self.sharded else self.model
        if model is None:
            raise RuntimeError("under FSDP2 only rank 0 holds the whole model")
        return model

    def _kept(self) -> list[str]:
        """The names of the checkpoints kept for averaging (a list in the state from now on)."""
        if self.state.kept_checkpoints is None:
            self.state.kept_checkpoints = []
        return self.state.kept_checkpoints

    def save(self, folder: str | Path | None = None) -> None:
        """Save the resumable checkpoint (one atomic file: weights, optimizer, position, every
        process's RNG; under FSDP2 the optimizer's shards go to a folder that file names) and
        ``last.safetensors``, at a step boundary, into ``folder`` (default: the run's). Every
        process calls it; rank 0 writes."""
        folder = Path(folder) if folder is not None else self.run_folder
        if self.sharded:  # full weights on rank 0 (the run folder's format), the optimizer in shards
            weights, _ = full_state(self.model, None, sharded=True)
            optim = save_optimizer_shards(self.model, self.optimizer, folder, self.state.step, self.dist)
        else:
            weights, optim = full_state(self.model, self.optimizer, sharded=False)
        rng = self.dist.gather(ckpt.rng_state())
        if self.dist.is_main:
            assert rng is not None  # gathered on rank 0
            metrics = folder / "metrics.jsonl"
            self.state.metrics_bytes = metrics.stat().st_size if metrics.is_file() else 0
            if self.sharded:
                self._whole_model().load_state_dict(weights)
            ckpt.save_checkpoint(
                folder,
                self._whole_model(),
                {
                    "train_state": asdict(self.state),
                    "optimizer": optim,
                    "rng": rng if self.dist.enabled else rng[0],
                    "world_size": self.dist.world_size,
                    **self._ema_state(),
                },
                weights=weights,
            )
            remove_optimizer_shards(folder, keep=optim["shards"] if self.sharded and optim else None)
        self.dist.barrier()

    def resume(self, *, trust: bool = False) -> None:
        """Restore weights, optimizer, position and RNG from the run folder (saved by any number of
        processes), cut ``metrics.jsonl`` back to that step and clear what a killed process left.
        ``trust``: see :func:`qkv.training.checkpoint_files.load_checkpoint` (rank 0 converts; the others wait)."""
        run_dir = self.run_folder
        if trust and self.dist.enabled:  # one process rewrites the file; the others then read the safe form
            if self.dist.is_main:
                ckpt.load_checkpoint(run_dir, clean=True, trust=True)
            self.dist.barrier()
        saved = ckpt.load_checkpoint(run_dir, clean=self.dist.is_main, trust=trust and not self.dist.enabled)
        weights = saved["model"] if "model" in saved else ckpt.read_weights(run_dir / "last.safetensors")
        shapes_of = self._shadow if self.sharded else self.model  # the whole model's shapes (rank 0 under FSDP2)
        if shapes_of is not None:
            ckpt.check_saved_weights(shapes_of, weights, run_dir / ckpt.CHECKPOINT_FILE)
        fields = saved["train_state"]
        unknown = sorted(set(fields) - {f.name for f in dataclass_fields(TrainState)} - {"best_bleu"})
        if unknown:
            raise ValueError(
                f"{run_dir / ckpt.CHECKPOINT_FILE}: train_state holds fields qkv does not write: {unknown[:5]}"
            )
        optim = saved["optimizer"]
        shards = optim.get("shards") if isinstance(optim, dict) else None
        load_full_state(self.model, self.optimizer, weights, None if shards else optim, self.sharded)
        if shards:  # written by FSDP2: read back resharded for this run's processes and strategy
            load_optimizer_shards(self.model, self.optimizer, run_dir / shards)
        rng = saved.get("rng", {"cpu": saved.get("torch_rng")})  # the oldest runs: the CPU state only
        per_process = rng if isinstance(rng, list) else [rng]
        if len(per_process) == self.dist.world_size or self.dist.rank < len(per_process):
            ckpt.set_rng_state(per_process[self.dist.rank])
        else:  # more processes than saved: a fresh, reproducible stream for this one
            torch.manual_seed(self.config.seed + 1_000_003 * self.dist.rank + saved["train_state"]["step"])
        if self.dist.is_main and len(per_process) != self.dist.world_size and saved["train_state"]["step"]:
            logger.info(
                "the checkpoint holds the random state of %d %s, resuming on %d: same weights, "
                "optimizer and data position; dropout masks differ from an uninterrupted run",
                len(per_process),
                "process" if len(per_process) == 1 else "processes",
                self.dist.world_size,
            )
        if self.ema is not None and "ema" in saved:
            self.ema.load_state_dict(saved["ema"])
        elif self.ema is not None and self.dist.is_main:  # --ema-decay given on resume: the average starts now
            logger.info("the moving average of the weights starts at step %d", saved["train_state"]["step"])
        fields = dict(saved["train_state"])
        if "best_bleu" in fields:  # runs saved before the field's rename
            fields["best_score"] = fields.pop("best_bleu")
        self.state = TrainState(**fields)
        self.state.kept_checkpoints = self.state.kept_checkpoints or []
        metrics = self.metrics_path
        if self.state.one_way_from_epoch >= 0:  # past --both-directions-until when saved
            self.task.drop_reversed_pairs()
            self._batches_epoch = None  # any epoch's batches made before are rebuilt
        if self.dist.is_main:
            if (
                "metrics_bytes" in saved["train_state"]
                and metrics is not None
                and metrics.is_file()
                and (metrics.stat().st_size > self.state.metrics_bytes)
            ):
                with open(metrics, "r+b") as handle:  # lines logged after the saved step are replayed
                    handle.truncate(self.state.metrics_bytes)
            self._remove_unkept_checkpoints()
            remove_optimizer_shards(run_dir, keep=shards)
            if self.state.step:
                logger.info(
                    "resumed at step %d (epoch %d, %.1f minutes done)",
                    self.state.step,
                    self.state.epoch,
                    self.state.seconds / 60,
                )
        self.dist.barrier()

    def _save_after_failure(self, step_start: tuple | None) -> None:
        """After Ctrl-C or a failure inside the loop, save the last whole step: a partly done step
        is dropped (its batches and dropout masks are replayed on resume). With several processes
        the others may be gone, so rank 0 saves alone, without collectives; under FSDP2 that is
        impossible (the weights are sharded) and the last periodic checkpoint stands."""
        s = self.state
        if step_start is not None and s.step == step_start[3]:
            s.epoch, s.batch_in_epoch = step_start[0], step_start[1]
            ckpt.set_rng_state(step_start[2])
        if not self.dist.is_main:
            return
        if self.sharded:
            logger.warning("stopping: under FSDP the last periodic checkpoint is kept (step in state.pt)")
            return
        logger.warning("stopping: saving a checkpoint at step %d", s.step)
        try:
            with sigterm_held():  # torchrun's SIGTERM after a lost rank must not cut this save short
                if self.dist.enabled:
                    self._save_alone(s)
                else:
                    self.save()
        except Exception as save_err:  # e.g. a full disk: the previous checkpoint is still whole
            on_disk = ckpt.saved_step(self.run_folder)
            logger.error(
                "could not save the checkpoint of step %d (%s); %s",
                s.step,
                str(save_err).strip().splitlines()[0][:200] if str(save_err).strip() else type(save_err).__name__,
                f"the run folder keeps step {on_disk}" if on_disk is not None else "no readable one is kept",
            )

    def _save_alone(self, s: TrainState) -> None:
        """Rank 0's save without collectives (the other processes may be gone)."""
        ckpt.save_checkpoint(
            self.run_folder,
            self.model,
            {
                "train_state": asdict(s),
                "rng": [ckpt.rng_state()],
                "optimizer": self.optimizer.state_dict(),
                "world_size": 1,
                **self._ema_state(),
            },
        )

    def _ema_state(self) -> dict:
        return {"ema": self.ema.state_dict()} if self.ema is not None else {}

    def keep_checkpoint(self) -> None:
        """Save ``checkpoints/step_<N>.safetensors`` (for averaging) and the resumable state. The
        new file is written, then the state that lists it, and only then are files the state no
        longer lists removed, so a crash at any point leaves a consistent folder."""
        model = self.plain_model()
        name, kept = f"step_{self.state.step}.safetensors", self._kept()
        if name not in kept:
            kept.append(name)
        del kept[: max(0, len(kept) - max(self.config.average_last, 1))]
        if self.dist.is_main:
            assert model is not None  # rank 0 holds the whole model
            ckpt.save_weights(model, self.run_folder / "checkpoints" / name)
        self.save()
        if self.dist.is_main:
            self._remove_unkept_checkpoints()

    def _remove_unkept_checkpoints(self) -> None:
        folder, kept = self.run_folder / "checkpoints", self._kept()
        if folder.is_dir():
            for path in folder.glob("step_*.safetensors"):
                if path.name not in kept:
                    path.unlink(missing_ok=True)
