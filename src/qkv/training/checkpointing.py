"""The run folder's checkpoints: :class:`Checkpoints`, an object the
:class:`~qkv.training.engine.Trainer` owns (``trainer.checkpoints``) and hands its
:class:`~qkv.training.config.TrainState`: the resumable state (:meth:`~Checkpoints.save`,
:meth:`~Checkpoints.resume`), the last whole step saved after Ctrl-C, SIGTERM or a failed step
(:meth:`~Checkpoints.save_after_failure`), and the checkpoints kept for averaging
(:meth:`~Checkpoints.keep`, :meth:`~Checkpoints.average`). Every write goes through
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

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from qkv.runtime.fileio import write_bytes
from qkv.training import checkpoint_files as ckpt
from qkv.training.config import TrainState
from qkv.training.distributed import (
    Distributed,
    full_state,
    load_full_state,
    load_optimizer_shards,
    remove_optimizer_shards,
    save_optimizer_shards,
)
from qkv.training.optimizer import check_resumable

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


class Checkpoints:
    """The run folder's checkpoints of one :class:`~qkv.training.engine.Trainer`, which owns this
    object and hands it the :class:`~qkv.training.config.TrainState` to save or keep; building it
    writes nothing.

    Args:
        run_dir: the run folder (None: a Trainer that never saves; saving then raises).
        model: the model trained (under FSDP2 its shards).
        optimizer: its optimizer.
        dist: this process's place among several.
        sharded: FSDP2: each process holds a shard of the weights and the optimizer's state.
        shadow: under FSDP2, rank 0's unsharded copy of the model (None on the other ranks).
        ema: the moving average of the weights, saved and restored with the rest (None: none).
        average_last: how many kept checkpoints :meth:`keep` holds on to (and :meth:`average` averages).
        seed: the run's seed (a process that the checkpoint holds no random state for seeds from it).
    """

    def __init__(
        self,
        *,
        run_dir: str | Path | None,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        dist: Distributed,
        sharded: bool = False,
        shadow: nn.Module | None = None,
        ema: AveragedModel | None = None,
        average_last: int = 1,
        seed: int = 0,
    ) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.model, self.optimizer, self.dist, self.sharded = model, optimizer, dist, sharded
        self.shadow, self.ema = shadow, ema
        self.average_last, self.seed = average_last, seed
        self.metrics_path = self.run_dir / "metrics.jsonl" if self.run_dir is not None else None

    @property
    def run_folder(self) -> Path:
        """The run folder, for a Trainer built with one."""
        if self.run_dir is None:
            raise ValueError("this Trainer was built without a run folder (run_dir=None): it cannot save or resume")
        return self.run_dir

    def whole_model(self) -> nn.Module:
        """Rank 0's whole model: the model, or under FSDP2 its unsharded copy."""
        model = self.shadow if self.sharded else self.model
        if model is None:
            raise RuntimeError("under FSDP2 only rank 0 holds the whole model")
        return model

    def plain_model(self) -> nn.Module | None:
        """The whole model as one module, to validate and save with: the model itself, or under
        FSDP2 rank 0's unsharded copy refreshed from the shards (a collective: every process calls
        it; the others get None)."""
        if not self.sharded:
            return self.model
        weights, _ = full_state(self.model, None, sharded=True)
        if self.dist.is_main:
            self.whole_model().load_state_dict(weights)
        return self.shadow

    @staticmethod
    def kept(state: TrainState) -> list[str]:
        """The names of the checkpoints ``state`` keeps for averaging (a list in the state from now on)."""
        if state.kept_checkpoints is None:
            state.kept_checkpoints = []
        return state.kept_checkpoints

    def save(self, state: TrainState, folder: str | Path | None = None) -> None:
        """Save the resumable checkpoint (one atomic file: weights, optimizer, ``state``, every
        process's RNG; under FSDP2 the optimizer's shards go to a folder that file names) and
        ``last.safetensors``, at a step boundary, into ``folder`` (default: the run's). Every
        process calls it; rank 0 writes. ``state.metrics_bytes`` is set to the log's length."""
        folder = Path(folder) if folder is not None else self.run_folder
        if self.sharded:  # full weights on rank 0 (the run folder's format), the optimizer in shards
            weights, _ = full_state(self.model, None, sharded=True)
            optim = save_optimizer_shards(self.model, self.optimizer, folder, state.step, self.dist)
        else:
            weights, optim = full_state(self.model, self.optimizer, sharded=False)
        rng = self.dist.gather(ckpt.rng_state())
        if self.dist.is_main:
            assert rng is not None  # gathered on rank 0
            metrics = folder / "metrics.jsonl"
            state.metrics_bytes = metrics.stat().st_size if metrics.is_file() else 0
            if self.sharded:
                self.whole_model().load_state_dict(weights)
            ckpt.save_checkpoint(
                folder,
                self.whole_model(),
                {
                    "train_state": asdict(state),
                    "optimizer": optim,
                    "rng": rng if self.dist.enabled else rng[0],
                    "world_size": self.dist.world_size,
                    **self._ema_state(),
                },
                weights=weights,
            )
            remove_optimizer_shards(folder, keep=optim["shards"] if self.sharded and optim else None)
        self.dist.barrier()

    def resume(self, *, trust: bool = False) -> TrainState:
        """Restore weights, optimizer, EMA and RNG from the run folder (saved by any number of
        processes), cut ``metrics.jsonl`` back to that step and clear what a killed process left.
        ``trust``: see :func:`qkv.training.checkpoint_files.load_checkpoint` (rank 0 converts; the others wait).

        Returns:
            The saved :class:`~qkv.training.config.TrainState` (the position to go on from).
        """
        run_dir = self.run_folder
        if trust and self.dist.enabled:  # one process rewrites the file; the others then read the safe form
            if self.dist.is_main:
                ckpt.load_checkpoint(run_dir, clean=True, trust=True)
            self.dist.barrier()
        saved = ckpt.load_checkpoint(run_dir, clean=self.dist.is_main, trust=trust and not self.dist.enabled)
        weights = saved["model"] if "model" in saved else ckpt.read_weights(run_dir / "last.safetensors")
        shapes_of = self.shadow if self.sharded else self.model  # the whole model's shapes (rank 0 under FSDP2)
        if shapes_of is not None:
            ckpt.check_saved_weights(shapes_of, weights, run_dir / ckpt.CHECKPOINT_FILE)
        unknown = sorted(set(saved["train_state"]) - {f.name for f in dataclass_fields(TrainState)} - {"best_bleu"})
        if unknown:
            raise ValueError(
                f"{run_dir / ckpt.CHECKPOINT_FILE}: train_state holds fields qkv does not write: {unknown[:5]}"
            )
        optim = saved["optimizer"]
        check_resumable(self.optimizer, optim)  # a state of the other --optimizer is refused in one line
        shards = optim.get("shards") if isinstance(optim, dict) else None
        load_full_state(self.model, self.optimizer, weights, None if shards else optim, self.sharded)
        if shards:  # written by FSDP2: read back resharded for this run's processes and strategy
            load_optimizer_shards(self.model, self.optimizer, run_dir / shards)
        self._restore_rng(saved)
        if self.ema is not None and "ema" in saved:
            self.ema.load_state_dict(saved["ema"])
        elif self.ema is not None and self.dist.is_main:  # --ema-decay given on resume: the average starts now
            logger.info("the moving average of the weights starts at step %d", saved["train_state"]["step"])
        fields = dict(saved["train_state"])
        if "best_bleu" in fields:  # runs saved before the field's rename
            fields["best_score"] = fields.pop("best_bleu")
        state = TrainState(**fields)
        state.kept_checkpoints = state.kept_checkpoints or []
        if self.dist.is_main:
            self._tidy_after_resume(state, log_bytes="metrics_bytes" in saved["train_state"], shards=shards)
        self.dist.barrier()
        return state

    def _restore_rng(self, saved: dict) -> None:
        """This process's random state as saved, or where the checkpoint holds none for it, a fresh,
        reproducible stream (the one deliberate seeding in the library)."""
        rng = saved.get("rng", {"cpu": saved.get("torch_rng")})  # the oldest runs: the CPU state only
        per_process = rng if isinstance(rng, list) else [rng]
        step = saved["train_state"]["step"]
        if len(per_process) == self.dist.world_size or self.dist.rank < len(per_process):
            ckpt.set_rng_state(per_process[self.dist.rank])
        else:  # more processes than saved: a fresh, reproducible stream for this one
            torch.manual_seed(self.seed + 1_000_003 * self.dist.rank + step)
        if self.dist.is_main and len(per_process) != self.dist.world_size and step:
            logger.info(
                "the checkpoint holds the random state of %d %s, resuming on %d: same weights, "
                "optimizer and data position; dropout masks differ from an uninterrupted run",
                len(per_process),
                "process" if len(per_process) == 1 else "processes",
                self.dist.world_size,
            )

    def _tidy_after_resume(self, state: TrainState, *, log_bytes: bool, shards: str | None) -> None:
        """Rank 0 after a resume: lines logged after the saved step are cut (they are replayed), and
        files the state does not list are removed. ``log_bytes``: the state recorded the log's length."""
        metrics = self.metrics_path
        if log_bytes and metrics is not None and metrics.is_file() and metrics.stat().st_size > state.metrics_bytes:
            with open(metrics, "r+b") as handle:
                handle.truncate(state.metrics_bytes)
        self._remove_unkept_checkpoints(state)
        remove_optimizer_shards(self.run_folder, keep=shards)
        if state.step:
            logger.info("resumed at step %d (epoch %d, %.1f minutes done)", state.step, state.epoch, state.seconds / 60)

    def save_after_failure(self, state: TrainState, step_start: tuple | None) -> None:
        """After Ctrl-C or a failure inside the loop, save the last whole step: a partly done step
        is dropped (its batches and dropout masks are replayed on resume). ``step_start``:
        ``(epoch, batch_in_epoch, rng_state, step)`` taken before the step began. With several processes
        the others may be gone, so rank 0 saves alone, without collectives; under FSDP2 that is
        impossible (the weights are sharded) and the last periodic checkpoint stands."""
        s = state
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
                    self.save(s)
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

    def keep(self, state: TrainState) -> None:
        """Save ``checkpoints/step_<N>.safetensors`` (for averaging) and the resumable state. The
        new file is written, then the state that lists it, and only then are files the state no
        longer lists removed, so a crash at any point leaves a consistent folder."""
        model = self.plain_model()
        name, kept = f"step_{state.step}.safetensors", self.kept(state)
        if name not in kept:
            kept.append(name)
        del kept[: max(0, len(kept) - max(self.average_last, 1))]
        if self.dist.is_main:
            assert model is not None  # rank 0 holds the whole model
            ckpt.save_weights(model, self.run_folder / "checkpoints" / name)
        self.save(state)
        if self.dist.is_main:
            self._remove_unkept_checkpoints(state)

    def average(self, state: TrainState, out: Path) -> None:
        """Keep the final weights (:meth:`keep`), then write the average of the last ``average_last``
        kept checkpoints to ``out`` (rank 0; every process calls it)."""
        self.keep(state)
        if self.dist.is_main:
            names = self.kept(state)[-self.average_last :]
            ckpt.average_weight_files([self.run_folder / "checkpoints" / n for n in names], out)
            logger.info("averaged %d checkpoint%s: %s", len(names), "" if len(names) == 1 else "s", ", ".join(names))

    def finish(self, state: TrainState, final_weights: str) -> Path:
        """Write ``model.safetensors`` into the run folder and return its path (every process calls it).

        Args:
            state: where the run stands (its kept checkpoints).
            final_weights: ``"best"``: the best validation's weights (once one ran), ``"ema"``: the moving
                average; otherwise the kept checkpoints averaged (with ``average_last`` above 1, the final
                weights among them) or the final weights. A run with an EMA also writes ``ema.safetensors``.

        Returns:
            The path of ``model.safetensors``.
        """
        folder = self.run_folder
        out, best, ema = folder / "model.safetensors", folder / "best.safetensors", folder / "ema.safetensors"
        if self.ema is not None and self.dist.is_main:
            ckpt.save_weights(self.ema.module, ema)
        if final_weights == "ema":
            if self.dist.is_main:
                write_bytes(out, ema.read_bytes())
        elif final_weights == "best" and best.is_file():
            if self.dist.is_main:
                write_bytes(out, best.read_bytes())
        elif self.average_last > 1:
            self.average(state, out)
        else:
            model = self.plain_model()
            if self.dist.is_main:
                assert model is not None  # rank 0 holds the whole model
                ckpt.save_weights(model, out)
        self.dist.barrier()
        return out

    def _remove_unkept_checkpoints(self, state: TrainState) -> None:
        folder, kept = self.run_folder / "checkpoints", self.kept(state)
        if folder.is_dir():
            for path in folder.glob("step_*.safetensors"):
                if path.name not in kept:
                    path.unlink(missing_ok=True)
