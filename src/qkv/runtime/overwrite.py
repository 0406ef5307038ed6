"""What ``--overwrite`` may replace: only a folder the same command made, recognised by what that
command wrote into it (an export's marker file, a prepared folder's manifest) and holding nothing
else, never by a file name other tools also write. The check runs before any work and deletes nothing.

Every command that builds a whole folder and may replace an earlier one (``qkv export``,
``qkv prepare``) calls :func:`check_output_folder` with the way to read back the files its own
earlier output lists; a refusal is one ``ValueError`` (or ``PermissionError``) naming the folder,
and it suggests ``--overwrite`` only where ``--overwrite`` would be accepted.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path, PurePosixPath

KEEP = "delete it yourself or choose a new folder"


def folder_entries(folder: Path) -> set[str]:
    """Every file, folder and link under ``folder`` (links not followed), as relative POSIX paths.

    Args:
        folder: an existing folder.

    Returns:
        the relative paths, ``folder`` itself not included.
    """
    found: set[str] = set()
    for root, dirs, files in os.walk(folder):  # os.walk lists links to folders in dirs and does not enter them
        base = Path(root).relative_to(folder)
        found.update((base / name).as_posix() for name in [*dirs, *files])
    return found


def unaccounted(folder: Path, listed: Iterable[str]) -> list[str]:
    """The entries of ``folder`` that neither are one of ``listed`` (relative file paths) nor hold one.

    Args:
        folder: an existing folder.
        listed: the files an earlier output recorded (relative POSIX paths).

    Returns:
        the other entries, sorted (empty when the folder holds only what was listed).
    """
    allowed: set[str] = set()
    for name in listed:
        path = PurePosixPath(name)
        allowed.add(path.as_posix())
        allowed.update(parent.as_posix() for parent in path.parents if parent != PurePosixPath("."))
    return sorted(folder_entries(folder) - allowed)


def _check_writable(out: Path) -> None:
    """``PermissionError`` naming the folder when ``out`` cannot be built next to, or replaced, where it is."""
    if out.exists():
        # replacing moves ``out`` into a folder beside it (which updates its ``..`` entry) and then
        # deletes its files: both the parent and ``out`` itself must be writable
        places = [out.parent, out]
    else:
        existing = next((p for p in out.parents if p.exists()), None)
        if existing is not None and not existing.is_dir():
            raise NotADirectoryError(f"{out}: lies under {existing}, which is a file; choose a new folder")
        places = [existing] if existing is not None else []
    for place in places:
        if place.is_dir() and not os.access(place, os.W_OK | os.X_OK):
            raise PermissionError(f"{place}: not writable; choose a folder you can write to")


def _check_place(
    out: Path, resolved: Path, refuse: Callable[[Path], str | None] | None, inputs: Sequence[str | Path]
) -> None:
    """``ValueError`` when ``refuse`` names ``resolved`` or a folder above it, or ``resolved`` holds an input."""
    if refuse is not None:
        for place in [resolved, *resolved.parents]:
            reason = refuse(place)
            if reason is None:
                continue
            if place == resolved:
                raise ValueError(f"{out}: {reason}, which qkv never replaces or writes into; choose a new folder")
            raise ValueError(f"{out}: lies inside {place}, {reason}; choose a folder outside it")
    for item in inputs:
        item_path = Path(item).resolve()
        if item_path == resolved or resolved in item_path.parents:
            raise ValueError(f"{out}: holds {item}, which this command reads; choose a new folder")


def check_output_folder(
    out: str | Path,
    *,
    overwrite: bool,
    what: str,
    own_files: Callable[[Path], set[str] | str],
    refuse: Callable[[Path], str | None] | None = None,
    inputs: Sequence[str | Path] = (),
    empty_needs_overwrite: bool = False,
) -> Path:
    """Check, before any work, that a command may build the folder ``out`` in place (writing nothing).

    ``out`` may be built when it does not exist or is an empty folder, and with ``overwrite`` when it
    holds an earlier output of this command and nothing else: ``own_files(out)`` lists the files that
    output recorded, and any other entry refuses it. Always refused: ``out`` or a folder above it that
    ``refuse`` names (a run folder, a prepared folder), a folder holding one of ``inputs`` or the
    current directory, and a place that is not writable.

    Args:
        out: the folder to build.
        overwrite: an earlier output of this command at ``out`` may be replaced.
        what: the output in messages, without an article ("Hugging Face export", "prepared folder").
        own_files: the files the earlier output at ``out`` lists (relative POSIX paths), or why ``out``
            is not such an output (a clause: "it has no manifest.json").
        refuse: why a folder (``out`` or any folder above it) must not be written into or replaced,
            or None when it may.
        inputs: files or folders the command reads, which must not lie inside ``out``.
        empty_needs_overwrite: an existing empty folder also needs ``overwrite``.

    Returns:
        ``out`` made absolute with its links and ``..`` resolved: the path to build at.

    Raises:
        ValueError: ``out`` may not be built or replaced (one line naming it, saying what to do).
        PermissionError: ``out``, or where it would be made, is not writable.
    """
    out = Path(out)
    if out.is_symlink():
        raise ValueError(f"{out}: a symbolic link, not a folder of its own; choose a new folder")
    resolved = out.resolve()  # "a/..", ".", links above: the folder they name, checked and built as such
    if resolved.exists() and not resolved.is_dir():
        raise ValueError(f"{out}: exists and is not a folder; choose a new folder")
    _check_place(out, resolved, refuse, inputs)
    if not resolved.exists():
        _check_writable(resolved)
        return resolved
    cwd = Path.cwd().resolve()
    if cwd == resolved or resolved in cwd.parents:
        raise ValueError(
            f"{out}: holds the current directory, which building the {what} there would replace; "
            "run qkv from another folder or choose a new folder"
        )
    if not any(resolved.iterdir()):
        if empty_needs_overwrite and not overwrite:
            raise ValueError(f"{out}: exists (empty); pass --overwrite to use it, or choose a new folder")
        _check_writable(resolved)
        return resolved
    listed = own_files(resolved)
    if isinstance(listed, str):
        raise ValueError(f"{out}: not empty, and {listed}; --overwrite replaces only an earlier {what}: {KEEP}")
    extra = unaccounted(resolved, listed)
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise ValueError(
            f"{out}: holds {extra[0]}{more}, which the earlier {what} there did not write; --overwrite will "
            "not delete it: move it out, or choose a new folder"
        )
    if not overwrite:
        raise ValueError(
            f"{out}: exists and holds an earlier {what}; pass --overwrite to replace it, or choose a new folder"
        )
    _check_writable(resolved)
    return resolved
