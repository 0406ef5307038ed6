"""The folder an export writes, the same way for every format: checked before any work, built aside,
and marked as qkv's own export so that a later ``--overwrite`` knows it.

Every export folder holds :data:`MARKER`, written last inside the folder's build: the format, the qkv
version and the list of the files the export wrote. ``--overwrite`` replaces a folder only when that
marker names the same format and the folder holds nothing it does not list
(:func:`qkv.runtime.overwrite.check_output_folder`). A run folder, a prepared folder and any folder
inside one are never written into or replaced, nor a folder holding the run being exported.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qkv.data.prepared.format import is_prepared_folder
from qkv.runs.folder import is_run_folder
from qkv.runtime.fileio import atomic_folder, read_json, write_json
from qkv.runtime.overwrite import check_output_folder as check_replaceable
from qkv.runtime.overwrite import folder_entries

MARKER = ".qkv-export.json"  # written by every export, last; its "files" list what --overwrite may delete
MARKER_FORMAT = 1

# format -> its name in messages
KINDS = {"hf": "Hugging Face export", "onnx": "ONNX export", "ctranslate2": "CTranslate2 export"}


def marked_files(folder: Path, kind: str) -> set[str] | str:
    """The files the export of format ``kind`` at ``folder`` wrote, as its :data:`MARKER` lists them,
    or why ``folder`` is not such an export (a clause for a message).

    Args:
        folder: an existing, non-empty folder.
        kind: a key of :data:`KINDS`.

    Returns:
        relative POSIX paths, or the reason.
    """
    path = folder / MARKER
    if not path.is_file() or path.is_symlink():
        return f"it has no {MARKER} (not a qkv export, or one from a qkv release that did not mark its exports)"
    try:
        marker = read_json(path)
    except (OSError, ValueError):
        marker = None
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, str) and f and not f.startswith("/") for f in files):
        return f"its {MARKER} is not one qkv wrote (no list of files)"
    found = marker.get("qkv_export")
    if found != kind:
        return f"it holds an export of another format ({found!r}, not {kind!r})"
    return {*files, MARKER}


def _never_replaced(folder: Path) -> str | None:
    """Why an export must not be written into or in place of ``folder``, or None."""
    if is_run_folder(folder):
        return "a qkv run folder"
    if is_prepared_folder(folder):
        return "a prepared folder"
    return None


def check_output_folder(out: str | Path, *, overwrite: bool, kind: str, run_dir: str | Path | None = None) -> Path:
    """Check, before any work, that an export of format ``kind`` may be built at ``out``: it does not
    exist, is an empty folder, or (with ``overwrite``) holds an earlier export of this format and nothing
    else; not a run or prepared folder nor inside one, not holding ``run_dir``, writable.

    Args:
        out: the folder the export will write.
        overwrite: an earlier export of this format at ``out`` may be replaced.
        kind: the format, a key of :data:`KINDS`.
        run_dir: the run being exported (``out`` must not hold it).

    Returns:
        the resolved path to build the export at.

    Raises:
        ValueError: ``out`` may not be written (one line saying why and what to do).
        PermissionError: ``out`` or where it would be made is not writable.
    """
    run = Path(run_dir).resolve() if run_dir is not None else None

    def refuse(folder: Path) -> str | None:
        reason = _never_replaced(folder)
        if reason is None and folder == run:  # a run folder is_run_folder does not know
            reason = "the run being exported"
        return reason

    return check_replaceable(
        out,
        overwrite=overwrite,
        what=KINDS[kind],
        own_files=lambda folder: marked_files(folder, kind),
        refuse=refuse,
        inputs=[run_dir] if run_dir is not None else [],
    )


def mark_export(folder: Path, kind: str) -> None:
    """Make the files of a finished export readable by all (0644, folders 0755) and write
    :data:`MARKER` listing them, last.

    Args:
        folder: the export being built (every file already written).
        kind: the format, a key of :data:`KINDS`.
    """
    from qkv import __version__

    for root, dirs, files in os.walk(folder):
        for names, mode in ((dirs, 0o755), (files, 0o644)):  # some writers (safetensors) create files 0600
            for name in names:
                if not (Path(root) / name).is_symlink():
                    os.chmod(Path(root) / name, mode)
    files = sorted(name for name in folder_entries(folder) if (folder / name).is_file())
    write_json(
        folder / MARKER, {"qkv_export": kind, "format": MARKER_FORMAT, "qkv_version": __version__, "files": files}
    )


@contextmanager
def building_export(out: Path, *, kind: str, tag: str) -> Iterator[Path]:
    """Yield an empty folder beside ``out`` to write the export into; when the block succeeds, mark it
    (:func:`mark_export`) and put it in place of ``out`` (:func:`qkv.runtime.fileio.atomic_folder`).
    The caller has checked ``out`` with :func:`check_output_folder`.

    Args:
        out: the resolved folder to build (what :func:`check_output_folder` returned).
        kind: the format, a key of :data:`KINDS`.
        tag: the temporary folder's tag (``.<name>.<tag>-<random>``).
    """
    with atomic_folder(out, tag=tag) as tmp:
        yield tmp
        mark_export(tmp, kind)
