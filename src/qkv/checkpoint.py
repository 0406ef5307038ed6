"""Run folders on disk: weights (safetensors), config (JSON), tokenizer and the resumable
checkpoint, each written atomically (:mod:`qkv.fileio`).

A run folder holds::

    config.json          {"qkv_run": 2, "model": TransformerConfig fields, "train": TrainConfig fields,
                          "data": {...}, "data_fingerprint": {...}}; a language model's also has
                          "task": "lm", CausalLMConfig fields as "model", and "lm": {tokenizer, windows,
                          splits: where each split came from and its token count}
    tokenizer.json       the joint BPE tokenizer (a language model's: character or BPE)
    train.bin, val.bin,  a language model's token arrays (qkv.data.text); test.bin is never read by
    test.bin             training (only qkv evaluate scores it)
    state.pt             the resumable checkpoint, ONE file: weights, optimizer, step, epoch, position
                         in the epoch, RNG states (what --resume reads)
    last.safetensors     the weights at the last saved step (written after state.pt, from the same step)
    model.safetensors    the weights to translate with (the average of the last checkpoints, if made)
    best.safetensors     the weights with the best validation BLEU
    checkpoints/         step_<N>.safetensors kept for checkpoint averaging
    metrics.jsonl        one JSON object per log/validation event
    curves.png           training loss and validation BLEU against minutes

The ``qkv_run`` key marks a folder as a qkv run: ``--overwrite`` replaces nothing else. Because the
resumable checkpoint is a single file replaced atomically, a crash at any moment leaves either the
previous step's checkpoint or the new one, never weights from one step with the state of another.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file, save_model

from qkv.data.tokenizer import Tokenizer
from qkv.fileio import atomic_folder, atomic_path, read_json, remove_stale_temporaries, write_json
from qkv.models import Transformer, TransformerConfig
from qkv.safe_load import (TensorInfo, build_within_weights, check_layer_counts, check_shapes, check_zip_members,
                           meta_shapes, plain_values, refused_global, weights_header)

logger = logging.getLogger(__name__)

RUN_MARKER = "qkv_run"  # config.json key that marks a qkv run folder; its value is the format version
RUN_FORMAT = 2  # 2: state.pt holds the weights too (one atomic checkpoint)
CHECKPOINT_FILE = "state.pt"


def save_weights(model: torch.nn.Module, path: str | Path, *, step: int | None = None) -> None:
    """Save weights as safetensors (tied tensors stored once), atomically; ``step`` goes in the metadata."""
    with atomic_path(path) as tmp:
        save_model(model, str(tmp), metadata=None if step is None else {"step": str(step)})


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Load safetensors weights into ``model``; every tensor must match (names and shapes).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is damaged or does not fit the model (one line naming the first problem).
    """
    path = Path(path)
    expected, tied = meta_shapes(model)  # tied weights are stored once: any name of a tied group stands for it
    check_shapes(expected, weights_header(path), config_path="the model", weights_path=path, tied=tied)
    tensors = read_weights(path)
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in tensors.items():
            state[name].copy_(tensor)


def average_weight_files(paths: list[Path], out_path: str | Path) -> None:
    """Average several safetensors files of one model (Vaswani et al. section 6.1 averages the last 5)."""
    if not paths:
        raise ValueError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    for p in paths:
        for name, tensor in load_file(str(p)).items():
            total[name] = total.get(name, 0) + tensor.double()
    averaged = {name: (t / len(paths)).float().contiguous() for name, t in total.items()}
    with atomic_path(out_path) as tmp:
        save_file(averaged, str(tmp), metadata={"format": "pt"})


def rng_state() -> dict:
    """This process's random state (CPU, and every CUDA device), as the checkpoint keeps it."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: str | Path, model: torch.nn.Module, state: dict, *, weights: dict | None = None) -> None:
    """Write the resumable checkpoint: ``state.pt`` (the weights, default ``model.state_dict()``,
    plus ``state``: optimizer, position, RNG) as one atomic file, then ``last.safetensors`` from
    ``model`` for translating."""
    run_dir = Path(run_dir)
    step = int(state["train_state"]["step"])
    weights = model.state_dict() if weights is None else weights
    with atomic_path(run_dir / CHECKPOINT_FILE) as tmp:
        torch.save({**state, "format": RUN_FORMAT, "step": step, "model": weights}, tmp)
    save_weights(model, run_dir / "last.safetensors", step=step)


def load_checkpoint(run_dir: str | Path, *, clean: bool = True, trust: bool = False) -> dict:
    """Read ``state.pt``: ``{"model": weights (absent in runs written before format 2), "optimizer",
    "train_state", "rng", ...}``. With ``clean``, stale temporary files of a killed writer are
    removed first (only the one process that writes may do that).

    The file is read with ``torch.load(weights_only=True)``: tensors, numbers, strings and
    containers, never a pickled object, whose loading could run any code (qkv writes nothing else).
    A file holding such objects is refused, unless ``trust`` (``qkv train --resume
    --trust-checkpoint``, for a run the user made with an older qkv): it is then loaded in full
    once and rewritten in the safe form, or refused if even that form cannot hold it.

    Runs written before format 2 kept the weights only in ``last.safetensors``; for those its step
    must equal the state's, else the run is refused.
    """
    run_dir = Path(run_dir)
    path = run_dir / CHECKPOINT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no training state to resume from")
    if clean:
        for stale in remove_stale_temporaries(run_dir):
            logger.info("removed %s, left by an interrupted write", stale)
    check_zip_members(path)
    try:
        saved = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        if not trust:
            raise ValueError(f"{path}: holds pickled Python objects ({refused_global(err)}), which qkv never loads: "
                             "loading them could run any code. If you made this run yourself with an older qkv, "
                             "resume once with --trust-checkpoint to convert it") from None
        saved = _convert_trusted_checkpoint(path)
    except Exception as err:  # noqa: BLE001 - torch raises many types for a damaged file
        raise ValueError(f"{path}: damaged training state ({type(err).__name__}); the run cannot be resumed") from None
    _check_state_layout(saved, path)
    if "model" not in saved:
        weights = run_dir / "last.safetensors"
        with safe_open(str(weights), framework="pt") as handle:
            step = (handle.metadata() or {}).get("step")
        if step is not None and int(step) != saved["train_state"]["step"]:
            raise ValueError(f"{weights} holds step {step} but {path} step {saved['train_state']['step']}")
    return saved


def check_saved_weights(model: torch.nn.Module, weights: dict, path: str | Path) -> None:
    """The weights a checkpoint holds fit ``model`` (names and shapes), else one ``ValueError`` line."""
    expected, tied = meta_shapes(model)
    header = {name: TensorInfo(tuple(t.shape), "F32" if t.is_floating_point() else str(t.dtype))
              for name, t in weights.items()}
    check_shapes(expected, header, config_path="config.json", weights_path=path, tied=tied)


def saved_step(run_dir: str | Path) -> int | None:
    """The step the run folder's ``state.pt`` holds, read back from the file (None if it cannot be
    read): what a message after a failed save reports, rather than the step it meant to save."""
    try:
        saved = torch.load(Path(run_dir) / CHECKPOINT_FILE, weights_only=True, map_location="cpu", mmap=True)
        return int(saved["train_state"]["step"])  # mapped: the weights are not read to learn one number
    except Exception:  # noqa: BLE001 - missing, damaged or foreign: nothing to report
        return None


def _convert_trusted_checkpoint(path: Path) -> dict:
    """Load a ``state.pt`` the user vouched for in full, and rewrite it in the form the safe loader
    reads (refused if that form cannot hold what it contains)."""
    try:
        saved = torch.load(path, weights_only=False, map_location="cpu")  # the user asked: --trust-checkpoint
    except Exception as err:  # noqa: BLE001 - torch raises many types for a damaged file
        raise ValueError(f"{path}: damaged training state ({type(err).__name__}); the run cannot be resumed") from None
    saved = plain_values(saved)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(f"{path}: holds objects qkv never writes ({refused_global(err)}); it cannot be converted "
                         "to the safe form") from None
    with atomic_path(path) as tmp:
        tmp.write_bytes(buffer.getvalue())
    logger.warning("%s: converted to the safe checkpoint form (--trust-checkpoint); later resumes need no flag", path)
    return saved


def _check_state_layout(saved: object, path: Path) -> None:
    """The keys and types resuming relies on, so a foreign file is one line, not a traceback later."""
    if not isinstance(saved, dict) or not isinstance(saved.get("train_state"), dict) or "optimizer" not in saved:
        raise ValueError(f"{path}: not a qkv training state")
    step = saved["train_state"].get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"{path}: train_state.step is {step!r}, not a step count")
    weights = saved.get("model")
    if weights is not None and not (isinstance(weights, dict) and all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items())):
        raise ValueError(f"{path}: its model weights are not a mapping of names to tensors")


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file (``ValueError`` in one line if it is damaged)."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise ValueError(f"{path}: not a readable safetensors file ({str(err).splitlines()[0][:200]})") from None


def is_run_folder(path: str | Path) -> bool:
    """True when ``path`` holds a config.json that marks it as a qkv run (or a run made before the
    marker existed: a config with model, train and data sections next to tokenizer.json)."""
    config_path = Path(path) / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict):
        return False
    if RUN_MARKER in config:
        return True
    return {"model", "train", "data"} <= set(config) and (Path(path) / "tokenizer.json").is_file()


def read_run_config(run_dir: str | Path) -> dict:
    """The run folder's ``config.json``; ``FileNotFoundError`` if it is not a run folder."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not a qkv run folder (config.json missing)")
    config = read_json(path)
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise ValueError(f"{path}: not a qkv run config (no 'model' section)")
    return config


def run_task(config: dict) -> str:
    """What a run's model does: ``"translation"`` (an encoder-decoder) or ``"lm"`` (a language model)."""
    return config.get("task", "translation")


def load_run(run_dir: str | Path, weights: str = "model", *, task: str | None = None):
    """Load a trained run: a translation model or a language model.

    Args:
        run_dir: the run folder.
        weights: ``model`` (averaged/final; falls back to ``last``), ``best``, ``last`` or ``ema`` (the
            moving average of a run trained with ``--ema-decay``).
        task: the kind of run the caller can use (``"translation"`` or ``"lm"``); another kind
            raises ``ValueError`` saying which command fits it. None accepts either.

    Returns:
        ``(model in eval mode, tokenizer, config dict)``: a :class:`~qkv.models.Transformer` and
        its BPE tokenizer, or a :class:`~qkv.causal_lm.CausalLM` and its character or BPE tokenizer.

    Raises:
        FileNotFoundError / ValueError: a missing or damaged file, in one line naming it.
    """
    from qkv.data.text import load_text_tokenizer

    run_dir = Path(run_dir)
    config = read_run_config(run_dir)
    kind = run_task(config)
    if task is not None and kind != task:
        hint = "qkv generate / qkv evaluate" if kind == "lm" else "qkv translate / qkv evaluate"
        what = "a language-model run" if kind == "lm" else "a translation run"
        raise ValueError(f"{run_dir}: {what}; use {hint} with it")
    path = run_dir / f"{weights}.safetensors"
    if weights == "model" and not path.is_file():
        path = run_dir / "last.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: weights file not found")
    model_config = read_model_config(run_dir, config)
    tokenizer = load_text_tokenizer(run_dir / "tokenizer.json") if kind == "lm" else Tokenizer.load(
        run_dir / "tokenizer.json")
    vocab = model_config.vocab_size if kind == "lm" else min(model_config.src_vocab_size, model_config.tgt_vocab_size)
    if kind == "lm" and not isinstance(tokenizer, Tokenizer) and tokenizer.vocab_size != vocab:  # characters
        raise ValueError(f"{run_dir / 'tokenizer.json'}: {tokenizer.vocab_size} characters but the model's vocabulary "
                         f"in config.json has {vocab}; the files do not belong together")
    if tokenizer.vocab_size > vocab:
        raise ValueError(f"{run_dir / 'tokenizer.json'}: {tokenizer.vocab_size} tokens, more than the model's "
                         f"vocabulary of {vocab} in config.json; the files do not belong together")
    model = build_run_model(run_dir, model_config, path)
    load_weights(model, path)
    model.eval()
    return model, tokenizer, config


def read_model_config(run_dir: str | Path, config: dict):
    """The run's model configuration (:class:`~qkv.models.TransformerConfig` or
    :class:`~qkv.causal_lm.CausalLMConfig`), checked field by field; one-line ``ValueError`` naming
    ``config.json`` otherwise. Nothing is built."""
    from dataclasses import fields

    from qkv.causal_lm import CausalLMConfig

    kind = CausalLMConfig if run_task(config) == "lm" else TransformerConfig
    # qkv has written every field since its first run folder: a missing one is damage, not an older
    # run, and its default would build another model without a word
    missing = [item.name for item in fields(kind) if item.name not in config["model"]]
    if missing:
        raise ValueError(f"{Path(run_dir) / 'config.json'}: the model section lacks {', '.join(missing)}")
    try:
        return kind.from_dict(config["model"])
    except (TypeError, ValueError) as err:
        raise ValueError(f"{Path(run_dir) / 'config.json'}: bad model section ({err})") from None


def build_run_model(run_dir: str | Path, model_config, weights_path: str | Path) -> torch.nn.Module:
    """Build the run's model (weights not loaded) once ``config.json`` has been compared with the
    header of ``weights_path``: layer counts, then every tensor's shape and the memory the model
    needs (:mod:`qkv.safe_load`), so a copied config asking for 10,000 layers or d_model 10^6 is a
    one-line error in a fraction of a second, not minutes and gigabytes."""
    from qkv.causal_lm import CausalLM, CausalLMConfig

    config_path = Path(run_dir) / "config.json"
    header = weights_header(weights_path)
    if isinstance(model_config, CausalLMConfig):
        layers = {"num_layers": ("decoder.layers.", model_config.num_layers)}
        make = CausalLM
    else:
        layers = {"num_encoder_layers": ("encoder.layers.", model_config.num_encoder_layers),
                  "num_decoder_layers": ("decoder.layers.", model_config.num_decoder_layers)}
        make = Transformer
    check_layer_counts(header, layers, config_path=config_path, weights_path=weights_path)
    return build_within_weights(lambda: make(model_config), header, config_path=config_path, weights_path=weights_path,
                                fields=vars(model_config))


def check_new_run_dir(run_dir: str | Path, *, overwrite: bool, inputs: list[str | Path] = ()) -> None:
    """Check that a new run may be created at ``run_dir``: it does not exist, or ``overwrite`` is
    given and :func:`check_replaceable` allows it. Raises ``ValueError``; deletes nothing."""
    if Path(run_dir).exists():
        if not overwrite:
            raise ValueError(f"{run_dir}: run folder exists; pass --resume to continue it or --overwrite to replace it")
        check_replaceable(run_dir, inputs=inputs)


def check_replaceable(run_dir: str | Path, *, inputs: list[str | Path] = ()) -> None:
    """Check that ``--overwrite`` may replace ``run_dir``: it must be a qkv run folder or an empty
    folder, must not hold the current directory, and must not hold any of ``inputs`` (the files
    the new run reads). Raises ``ValueError`` saying which rule failed; deletes nothing."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        return
    if not run_dir.is_dir() or run_dir.is_symlink():
        raise ValueError(f"{run_dir}: exists and is not a folder; --overwrite only replaces a qkv run folder")
    resolved = run_dir.resolve()
    if not (is_run_folder(run_dir) or not any(run_dir.iterdir())):
        raise ValueError(f"{run_dir}: not a qkv run folder (no config.json marked '{RUN_MARKER}') and not empty; "
                         "--overwrite only replaces a run folder: choose another --run-dir")
    cwd = Path.cwd().resolve()
    if cwd == resolved or resolved in cwd.parents:
        raise ValueError(f"{run_dir}: holds the current directory; --overwrite will not replace it")
    for item in inputs:
        if item and (resolved == Path(item).resolve() or resolved in Path(item).resolve().parents):
            raise ValueError(f"{item}: the new run reads this file, and it lies inside {run_dir}, which "
                             "--overwrite would replace; move it or choose another --run-dir")


def create_run(run_dir: str | Path, config: dict, tokenizer: Tokenizer, *, overwrite: bool = False,
               write_initial=None, inputs: list[str | Path] = ()) -> Path:
    """Create a run folder holding ``config.json`` (marked as a qkv run) and ``tokenizer.json``.

    The folder is assembled under a temporary name (with ``write_initial(folder)`` adding e.g. the
    step-0 checkpoint) and renamed into place, so a failure never leaves a half-made run folder.
    With ``overwrite``, an existing run folder (see :func:`check_replaceable`) is replaced only
    once the new one is complete.

    Raises:
        ValueError: ``run_dir`` exists and ``overwrite`` is False, or it may not be replaced.
    """
    run_dir = Path(run_dir)
    if run_dir.exists():
        if not overwrite:
            raise ValueError(f"{run_dir}: run folder exists; pass --resume to continue it or --overwrite to replace it")
        check_replaceable(run_dir, inputs=inputs)
    with atomic_folder(run_dir, tag="new") as tmp:
        write_json(tmp / "config.json", {RUN_MARKER: RUN_FORMAT, **config})
        tokenizer.save(tmp / "tokenizer.json")
        (tmp / "checkpoints").mkdir()
        if write_initial is not None:
            write_initial(tmp)
    return run_dir


def write_config(run_dir: str | Path, config: dict) -> None:
    """Rewrite a run's ``config.json`` (atomically), keeping the run marker."""
    write_json(Path(run_dir) / "config.json", {RUN_MARKER: config.get(RUN_MARKER, RUN_FORMAT), **config})
