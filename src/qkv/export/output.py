"""The folder an export writes: checked before any work, the same way for every format."""

from __future__ import annotations

from pathlib import Path


def check_output_folder(out: Path, *, overwrite: bool, kind: str, marks: tuple[str, ...]) -> None:
    """``out`` must not exist, be an empty folder, or (with ``overwrite``) hold an earlier export of
    this kind, recognised by every file in ``marks``; ``ValueError`` in one line otherwise.

    Args:
        out: the folder the export will write.
        overwrite: an earlier export of this kind at ``out`` may be replaced.
        kind: the format's name in messages, with its article ("an ONNX", "a CTranslate2").
        marks: files every export of this kind holds (an earlier export has all of them).
    """
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: exists and is not a folder; {kind} export is a folder")
    if not out.exists() or not any(out.iterdir()):
        return
    earlier = all((out / name).is_file() for name in marks)
    if not (overwrite and earlier):
        hint = "; pass --overwrite to replace an earlier export" if earlier else "; choose a new folder"
        raise ValueError(f"{out}: not empty{hint}")
