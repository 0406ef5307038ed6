"""What the training steps achieve: model FLOP/s, MFU and the share of padded positions.

The engine (:mod:`qkv.training.engine`) asks :meth:`Throughput.work` for each step's figures (the
model FLOPs of its batches, :mod:`qkv.models.flops`, and their real and padded positions), sums them
over the processes with the token counts, and at each log line reads the window's
``tflops_per_s``, ``mfu`` and ``padding`` (:meth:`Throughput.window`) into ``metrics.jsonl``.

* ``tflops_per_s``: model FLOPs (forward + backward over the real tokens; an objective that runs
  ``copies`` passes, R-Drop's two, counts each) over the training seconds of the window, all processes.
* ``mfu``: that rate over the peak (:func:`qkv.runtime.peaks.peak_flops` of the device in the step's
  compute dtype, bfloat16 under bf16 autocast) times the number of processes; null where no peak is known.
* ``padding``: padded positions over all positions of the window's batches (source and target
  for a translation batch; 0 for a language model's full windows).

A model other than :class:`~qkv.models.transformer.Transformer` or :class:`~qkv.models.causal_lm.CausalLM`
(or a batch of another kind) has no count: its figures are null, never an error.

On a CPU, :meth:`Throughput.hint` names a machine that other programs load (a load average above the
core count when training starts) or steps that reach under ``SLOW_MFU`` of the measured peak, once a
run: threads that wait on each other's cores run many times slower than one thread would.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from qkv.data.batching import Batch
from qkv.models.causal_lm import CausalLMConfig
from qkv.models.flops import causal_lm_train_flops, transformer_train_flops
from qkv.models.transformer import TransformerConfig
from qkv.runtime.peaks import machine_busy, machine_load, peak_flops
from qkv.training.language_model_task import WindowBatch

logger = logging.getLogger(__name__)

SLOW_MFU = 0.02  # a share of the CPU's measured peak far below what a Transformer's training steps reach


def batch_work(config: object, batch: object) -> tuple[int | None, int, int] | None:
    """``(model FLOPs of a training pass, real positions, all positions)`` of one batch; FLOPs None
    where the model has no count; None where the batch is of no known kind."""
    if isinstance(batch, WindowBatch):
        b, s = batch.ids.shape
        flops = causal_lm_train_flops(config, [s] * b) if isinstance(config, CausalLMConfig) else None
        return flops, b * s, b * s
    if isinstance(batch, Batch) and isinstance(config, TransformerConfig):
        src = (batch.src != config.pad_id).sum(dim=1).tolist()
        tgt = (batch.tgt_out != config.pad_id).sum(dim=1).tolist()
        positions = batch.src.numel() + batch.tgt_out.numel()
        return transformer_train_flops(config, src, tgt), sum(src) + sum(tgt), positions
    return None


def _figure(value: float) -> float:
    return float(f"{value:.4g}")


class Throughput:
    """The model FLOPs and padding of the steps since the last log line, and the device's peak.

    Args:
        model: the plain model (its ``config`` says what a batch costs).
        device: where it trains.
        bf16: whether the steps run under bfloat16 autocast (the peak's dtype).
        world_size: processes training together (the peak is per process).
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, bf16: bool, world_size: int = 1) -> None:
        self.config: Any = getattr(model, "config", None)
        self.device = torch.device(device)
        self.hinted = False  # the busy-machine hint is given once a run
        self.windows = 0  # log windows seen (the first holds the warm-up)
        self.counted = isinstance(self.config, (TransformerConfig, CausalLMConfig))
        self.peak: float | None = None
        if self.counted:
            found = peak_flops(device, torch.bfloat16 if bf16 else torch.float32)
            if found is not None:
                self.peak = found[0] * world_size
                kind = "this machine's measured" if found[1].startswith("measured") else "the device's datasheet"
                logger.info(
                    "MFU (model FLOPs utilisation: the share of %s matmul peak the training steps reach) is "
                    "against %.4g TFLOP/s a process (%s)",
                    kind,
                    found[0] / 1e12,
                    found[1],
                )
        self.flops, self.real, self.positions = 0.0, 0.0, 0.0
        self.flops_known = self.counted

    def work(self, batches: Sequence[object], copies: int = 1) -> list[float]:
        """``[FLOPs, real positions, all positions]`` of this process's ``batches`` (zero-weight
        stand-ins, ``num_tgt_tokens == 0``, change nothing and count nothing), to sum over processes."""
        flops, real, positions = 0, 0, 0
        for batch in batches:
            if not getattr(batch, "num_tgt_tokens", 0):
                continue
            figures = batch_work(self.config, batch)
            if figures is None:
                self.flops_known = False
                continue
            step_flops, step_real, step_positions = figures
            if step_flops is None:
                self.flops_known = False
            flops += copies * (step_flops or 0)
            real, positions = real + step_real, positions + step_positions
        return [float(flops), float(real), float(positions)]

    def add(self, work: Sequence[float]) -> None:
        """Add a step's :meth:`work`, summed over the processes."""
        self.flops += work[0]
        self.real += work[1]
        self.positions += work[2]

    def window(self, seconds: float) -> dict[str, float | None]:
        """``tflops_per_s``, ``mfu`` and ``padding`` of the steps since the last call, over ``seconds``
        of training; then starts a new window."""
        rate = self.flops / max(seconds, 1e-9) if self.flops_known and self.flops else None
        record = {
            "tflops_per_s": None if rate is None else _figure(rate / 1e12),
            "mfu": None if rate is None or self.peak is None else _figure(rate / self.peak),
            "padding": round(1 - self.real / self.positions, 4) if self.positions else None,
        }
        self.flops, self.real, self.positions = 0.0, 0.0, 0.0
        self.flops_known = self.counted
        return record

    def hint(self, record: dict | None = None) -> str | None:
        """A one-line hint when the CPUs look shared with other work, at most once a run: at the start
        (``record`` None) when the load average is above the core count, later when a log ``record``'s
        MFU is under ``SLOW_MFU`` (after the first window, which holds the warm-up).

        Args:
            record: a log record from :meth:`window`, or None at the start of training.

        Returns:
            The hint, or None.
        """
        if self.hinted or self.device.type != "cpu":
            return None
        load, cores = machine_load()
        threads = torch.get_num_threads()
        advice = "try --threads 1" if threads > 1 else "steps run slower than on an idle machine"
        where = f"load {load:.1f} on {cores} core{'' if cores == 1 else 's'}" if load is not None else "load unknown"
        if record is None:
            if not machine_busy(load, cores):
                return None
            line = f"the machine is busy ({where}): {advice}"
        else:
            self.windows += 1
            mfu = record.get("mfu")
            if self.windows < 2 or mfu is None or mfu >= SLOW_MFU:
                return None
            line = (
                f"the steps reach {100 * mfu:.1f}% of this machine's measured matmul peak on {threads} "
                f"thread{'' if threads == 1 else 's'} ({where}): the CPUs may be shared with other work; {advice}"
            )
        self.hinted = True
        return line

    @staticmethod
    def postfix(record: dict) -> dict[str, str]:
        """The progress bar's part of a log ``record``: MFU, or the model TFLOP/s where no peak is known."""
        if record.get("mfu") is not None:
            return {"mfu": f"{100 * record['mfu']:.3g}%"}
        if record.get("tflops_per_s") is not None:
            return {"tflop_s": f"{record['tflops_per_s']:.3g}"}
        return {}
