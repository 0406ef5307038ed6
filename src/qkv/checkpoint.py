"""Run folders on disk: weights (safetensors), config (JSON), tokenizer and the resumable
checkpoint, each written atomically (:mod:`qkv.fileio`).

A run folder holds::

    config.json          {"qkv_run": 2, "model": TransformerConfig fields, "train": TrainConfig fields,
                          "data": {...}, "data_fingerprint": {...}}; a language model's also has
                          "task": "lm", CausalLMConfig fields as "model", and "lm": {tokenizer, windows}
    tokenizer.json       the joint BPE tokenizer (a language model's: character or BPE)
    train.bin, val.bin   a language model's token arrays (qkv.data.text)
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

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file, save_model

from qkv.data.tokenizer import Tokenizer
from qkv.fileio import atomic_folder, atomic_path, read_json, remove_stale_temporaries, write_json
from qkv.models import Transformer, TransformerConfig

logger = logging.getLogger(__name__)

RUN_MARKER = "qkv_run"  # config.json key that marks a qkv run folder; its value is the format version
RUN_FORMAT = 2  # 2: state.pt holds the weights too (one atomic checkpoint)
CHECKPOINT_FILE = "state.pt"


def save_weights(model: torch.nn.Module, path: str | Path, *, step: int | None = None) -> None:
    """Save weights as safetensors (tied tensors stored once), atomically; ``step`` goes in the metadata."""
    with atomic_path(path) as tmp:
        save_model(model, str(tmp), metadata=None if step is None else {"step": str(step)})


def _check_weights_file(model: torch.nn.Module, path: Path) -> None:
    """Compare a safetensors file's names and shapes with ``model`` before loading, so damage or a
    config that does not match the weights is a one-line ``ValueError``."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable safetensors file ({str(err).splitlines()[0][:200]})") from None
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name, shape in shapes.items():
        if name in expected and expected[name] != shape:
            raise ValueError(f"{path}: {name} has shape {list(shape)} but the run's config.json gives "
                             f"{list(expected[name])}; the weights and config.json do not belong together")
    unknown = sorted(set(shapes) - set(expected))
    if unknown:
        raise ValueError(f"{path}: tensors the model does not have: {unknown[:5]}")


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Load safetensors weights into ``model``; every tensor must match (names and shapes).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is damaged or does not fit the model (one line naming the first problem).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: weights file not found")
    _check_weights_file(model, path)
    tensors = read_weights(path)
    state = model.state_dict()
    # tied weights are stored once: a missing name is fine when the tensor it shares storage with is present
    by_storage = {}
    for name, tensor in state.items():
        by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(name)
    missing = [names for names in by_storage.values() if not any(n in tensors for n in names)]
    if missing:
        raise ValueError(f"{path}: weights missing for {[names[0] for names in missing][:5]}")
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


def load_checkpoint(run_dir: str | Path, *, clean: bool = True) -> dict:
    """Read ``state.pt``: ``{"model": weights (absent in runs written before format 2), "optimizer",
    "train_state", "rng", ...}``. With ``clean``, stale temporary files of a killed writer are
    removed first (only the one process that writes may do that).

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
    try:  # our own file (optimizer and RNG states are pickled): full unpickling is allowed
        saved = torch.load(path, weights_only=False, map_location="cpu")
    except Exception as err:  # noqa: BLE001 - torch raises many types for a damaged file
        raise ValueError(f"{path}: damaged training state ({type(err).__name__}); the run cannot be resumed") from None
    if not isinstance(saved, dict) or "train_state" not in saved or "optimizer" not in saved:
        raise ValueError(f"{path}: not a qkv training state")
    if "model" not in saved:
        weights = run_dir / "last.safetensors"
        with safe_open(str(weights), framework="pt") as handle:
            step = (handle.metadata() or {}).get("step")
        if step is not None and int(step) != saved["train_state"]["step"]:
            raise ValueError(f"{weights} holds step {step} but {path} step {saved['train_state']['step']}")
    return saved


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
    from qkv.causal_lm import CausalLM, CausalLMConfig
    from qkv.data.text import load_text_tokenizer

    run_dir = Path(run_dir)
    config = read_run_config(run_dir)
    kind = run_task(config)
    if task is not None and kind != task:
        hint = "qkv generate / qkv evaluate" if kind == "lm" else "qkv translate / qkv evaluate"
        what = "a language-model run" if kind == "lm" else "a translation run"
        raise ValueError(f"{run_dir}: {what}; use {hint} with it")
    try:
        if kind == "lm":
            model_config = CausalLMConfig.from_dict(config["model"])
            model = CausalLM(model_config)
            vocab = model_config.vocab_size
        else:
            model_config = TransformerConfig.from_dict(config["model"])
            model = Transformer(model_config)
            vocab = min(model_config.src_vocab_size, model_config.tgt_vocab_size)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{run_dir / 'config.json'}: bad model section ({err})") from None
    path = run_dir / f"{weights}.safetensors"
    if weights == "model" and not path.is_file():
        path = run_dir / "last.safetensors"
    load_weights(model, path)
    model.eval()
    tokenizer = load_text_tokenizer(run_dir / "tokenizer.json") if kind == "lm" else Tokenizer.load(
        run_dir / "tokenizer.json")
    if tokenizer.vocab_size > vocab:
        raise ValueError(f"{run_dir / 'tokenizer.json'}: {tokenizer.vocab_size} tokens, more than the model's "
                         f"vocabulary in config.json; the files do not belong together")
    return model, tokenizer, config


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
