"""Run folders: weights (safetensors), config (JSON), tokenizer and training state, written atomically.

A run folder holds::

    config.json          {"model": TransformerConfig fields, "train": TrainConfig fields, "data": {...}}
    tokenizer.json       the joint BPE tokenizer
    model.safetensors    the weights to translate with (the average of the last checkpoints, if made)
    last.safetensors     the weights at the last saved step (what --resume continues from)
    best.safetensors     the weights with the best validation BLEU
    state.pt             optimizer, step, epoch, position in the epoch, RNG states (for --resume)
    checkpoints/         step_<N>.safetensors kept for checkpoint averaging
    metrics.jsonl        one JSON object per log/validation event
    curves.png           training loss and validation BLEU against minutes

Every file is written to a temporary name in the same folder and renamed, so a crash never
leaves a half-written file behind.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from qkv.data.tokenizer import Tokenizer
from qkv.models import Transformer, TransformerConfig


@contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path next to ``path``; rename it onto ``path`` if the block succeeds."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a run folder is meant to be shared
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path: str | Path, data: dict) -> None:
    """Write ``data`` as indented JSON, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def save_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Save weights as safetensors (tied tensors stored once), atomically."""
    with atomic_path(path) as tmp:
        save_model(model, str(tmp))


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Load safetensors weights into ``model``; every tensor must match (names and shapes)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: weights file not found")
    missing, unexpected = load_model(model, str(path), strict=True)
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the model: missing {missing}, unexpected {unexpected}")


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


def save_training_state(path: str | Path, state: dict) -> None:
    """``torch.save`` the optimizer/RNG/position state, atomically."""
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def load_training_state(path: str | Path) -> dict:
    """Read what :func:`save_training_state` wrote (our own file: full unpickling is allowed)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no training state to resume from")
    return torch.load(path, weights_only=False)


def read_run_config(run_dir: str | Path) -> dict:
    """The run folder's ``config.json``; ``FileNotFoundError`` if it is not a run folder."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not a qkv run folder (config.json missing)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(config, dict) or "model" not in config:
        raise ValueError(f"{path}: not a qkv run config (no 'model' section)")
    return config


def load_run(run_dir: str | Path, weights: str = "model") -> tuple[Transformer, Tokenizer, dict]:
    """Load a trained run for translation.

    Args:
        run_dir: the run folder.
        weights: ``model`` (averaged/final; falls back to ``last``), ``best`` or ``last``.

    Returns:
        ``(model in eval mode, tokenizer, config dict)``.
    """
    run_dir = Path(run_dir)
    config = read_run_config(run_dir)
    model = Transformer(TransformerConfig.from_dict(config["model"]))
    path = run_dir / f"{weights}.safetensors"
    if weights == "model" and not path.is_file():
        path = run_dir / "last.safetensors"
    load_weights(model, path)
    model.eval()
    return model, Tokenizer.load(run_dir / "tokenizer.json"), config


def create_run(run_dir: str | Path, config: dict, tokenizer: Tokenizer, *, overwrite: bool = False) -> Path:
    """Create a run folder holding ``config.json`` and ``tokenizer.json``.

    The folder is assembled under a temporary name and renamed into place, so a failure never
    leaves a half-written run folder behind.

    Raises:
        ValueError: ``run_dir`` exists and ``overwrite`` is False (use --resume to continue it).
    """
    import shutil

    run_dir = Path(run_dir)
    if run_dir.exists():
        if not overwrite:
            raise ValueError(f"{run_dir}: run folder exists; pass --resume to continue it or --overwrite to replace it")
        shutil.rmtree(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=run_dir.parent, prefix=f".{run_dir.name}."))
    try:
        write_json(tmp / "config.json", config)
        tokenizer.save(tmp / "tokenizer.json")
        (tmp / "checkpoints").mkdir()
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700
        os.replace(tmp, run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return run_dir
