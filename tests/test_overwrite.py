"""``--overwrite`` replaces only what the same command made (issue 65, "nothing lost").

``qkv export --to hf|onnx|ctranslate2`` recognises an earlier export by the ``.qkv-export.json`` it
wrote, listing its files, and ``qkv prepare`` an earlier prepared folder by its manifest: a run folder,
a prepared folder (a run's own ``data/`` included), a folder inside one, a folder holding the run being
exported, a model folder someone downloaded and a folder of a user's files are refused, with and
without ``--overwrite``, every file surviving byte for byte, and the refusal suggests ``--overwrite``
only where it would be accepted. Refusals come before any work (nothing is loaded or written).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from qkv.cli import main
from qkv.runtime import overwrite as overwrite_module
from qkv.runtime.overwrite import check_output_folder, unaccounted

FIXTURES = Path(__file__).parent / "fixtures" / "runs_v0_1"
NEEDS = {"hf": "transformers", "onnx": "onnxruntime", "ctranslate2": "ctranslate2"}
MARKER = ".qkv-export.json"


def needs(kind: str) -> None:
    """Skip when the format's package is not installed (qkv[deploy])."""
    if importlib.util.find_spec(NEEDS[kind]) is None or (kind == "onnx" and importlib.util.find_spec("onnx") is None):
        pytest.skip(f"{NEEDS[kind]} not installed")


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder``: a file's bytes, None for a folder."""
    return {
        p.relative_to(folder).as_posix(): (None if p.is_dir() else p.read_bytes()) for p in sorted(folder.rglob("*"))
    }


def cli(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.fixture
def run(tmp_path) -> Path:
    """A copy of the v0.1 translation run (its state.pt, checkpoints and its own prepared data/)."""
    return shutil.copytree(FIXTURES / "translation_run", tmp_path / "runs" / "run")


@pytest.fixture
def pretrained(tmp_path) -> Path:
    """A downloaded model folder the user keeps notes in: config.json like every export's."""
    folder = tmp_path / "all-MiniLM-L6-v2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 384}))
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + bytes(range(64)))
    (folder / "notes.txt").write_text("fine-tuned on my own pairs: do not lose\n")
    return folder


@pytest.fixture
def user_folder(tmp_path) -> Path:
    folder = tmp_path / "mine"
    (folder / "sub").mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    (folder / "sub" / "table.csv").write_text("a,b\n1,2\n")
    return folder


def fake_export(folder: Path, kind: str, files: dict[str, str]) -> Path:
    """An export folder as qkv writes one (its files, then the marker listing them)."""
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    marker = {"qkv_export": kind, "format": 1, "qkv_version": "test", "files": sorted(files)}
    (folder / MARKER).write_text(json.dumps(marker))
    return folder


# ------------------------------------------------------------------ the shared check, without a model
def test_unaccounted_lists_what_the_marker_does_not(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "x.bin").write_bytes(b"1")
    (tmp_path / "y.txt").write_text("2")
    (tmp_path / "empty").mkdir()
    assert unaccounted(tmp_path, ["a/b/x.bin", "y.txt"]) == ["empty"]
    assert unaccounted(tmp_path, ["y.txt"]) == ["a", "a/b", "a/b/x.bin", "empty"]


def test_the_check_accepts_only_a_marked_export_holding_nothing_else(tmp_path):
    from qkv.export.output import check_output_folder as check_export

    earlier = fake_export(tmp_path / "ct2", "ctranslate2", {"model.bin": "w", "config.json": "{}"})
    assert check_export(earlier, overwrite=True, kind="ctranslate2") == earlier.resolve()
    with pytest.raises(ValueError, match="holds an earlier CTranslate2 export; pass --overwrite"):
        check_export(earlier, overwrite=False, kind="ctranslate2")
    with pytest.raises(ValueError, match="another format") as refused:  # an ONNX export is not replaced by hf
        check_export(earlier, overwrite=True, kind="hf")
    assert "pass --overwrite" not in str(refused.value)
    (earlier / "README.md").write_text("my notes")
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="holds README.md, which the earlier CTranslate2 export") as refused:
            check_export(earlier, overwrite=overwrite, kind="ctranslate2")
        assert "pass --overwrite" not in str(refused.value)
    forged = fake_export(tmp_path / "forged", "hf", {"notes.txt": "x"})
    (forged / MARKER).write_text(json.dumps({"qkv_export": "hf", "files": "notes.txt"}))
    with pytest.raises(ValueError, match="not one qkv wrote"):
        check_export(forged, overwrite=True, kind="hf")
    assert check_export(tmp_path / "new" / "deeper", overwrite=False, kind="hf") == (tmp_path / "new/deeper").resolve()
    assert not (tmp_path / "new").exists()  # the check writes nothing


def test_an_unwritable_folder_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """A read-only place fails in one line naming it, before the run is even loaded (as root, where
    permission bits do not stop writes, the denial is simulated at the access check)."""
    needs("ctranslate2")
    run_dir = shutil.copytree(FIXTURES / "translation_run", tmp_path / "run")
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.geteuid() == 0:
        real = os.access
        monkeypatch.setattr(
            overwrite_module.os,
            "access",
            lambda p, mode: False if Path(p).resolve() == locked.resolve() else real(p, mode),
        )
    else:
        locked.chmod(0o555)
    import qkv.export.ctranslate2

    def no_work(*args, **kwargs):
        raise AssertionError("the run was loaded before the folder was checked")

    monkeypatch.setattr(qkv.export.ctranslate2, "load_run", no_work)  # the name the exporter calls
    try:
        code, err = cli(capsys, "export", run_dir, "--to", "ctranslate2", locked / "ct2")
        assert code == 2 and "\n" not in err
        assert err.endswith(f"{locked}: not writable; choose a folder you can write to"), err
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


# ------------------------------------------------------------------------------ qkv export, every format
@pytest.mark.parametrize("kind", ["hf", "onnx", "ctranslate2"])
def test_export_never_replaces_what_it_did_not_make(kind, tmp_path, run, pretrained, user_folder, capsys):
    needs(kind)
    other_run = shutil.copytree(run, tmp_path / "other_run")
    legacy = tmp_path / "legacy"  # an export from before the marker: config.json and weights, no marker
    legacy.mkdir()
    (legacy / "config.json").write_text("{}")
    (legacy / "model.safetensors").write_bytes(b"old")
    wrong_kind = fake_export(tmp_path / "wrong", "hf" if kind != "hf" else "onnx", {"config.json": "{}"})
    mixed = fake_export(tmp_path / "mixed", kind, {"config.json": "{}"})
    (mixed / "notes.txt").write_text("mine")
    cases = {
        "the run itself": (run, "a qkv run folder"),
        "another run": (other_run, "a qkv run folder"),
        "a folder holding the run": (run.parent, "which this command reads"),
        "inside the run": (run / "checkpoints", f"lies inside {run}"),
        "the run's prepared data": (run / "data", "a prepared folder, which qkv never replaces"),
        "a new folder inside the run": (run / "export", f"lies inside {run}"),
        "a pretrained model": (pretrained, f"no {MARKER}"),
        "a user's folder": (user_folder, f"no {MARKER}"),
        "an unmarked export": (legacy, "delete it yourself or choose a new folder"),
        "another format's export": (wrong_kind, "another format"),
        "an export holding a user's file": (mixed, "holds notes.txt"),
    }
    before = {name: snapshot(folder) for name, (folder, _) in cases.items() if folder.exists()}
    for name, (folder, expected) in cases.items():
        for flag in ([], ["--overwrite"]):
            code, err = cli(capsys, "export", run, "--to", kind, folder, *flag)
            assert code == 2 and "\n" not in err, (name, err)
            assert expected in err, (name, err)
            assert "pass --overwrite" not in err, (name, err)  # --overwrite would be refused too
    for name, (folder, _) in cases.items():
        if name in before:
            assert snapshot(folder) == before[name], name
    assert not (run / "export").exists()
    leftovers = [p.name for p in tmp_path.rglob(".*") if p.name != MARKER]
    assert leftovers == []  # no temporary or moved-aside folder anywhere


def test_export_into_the_current_folder_is_refused(tmp_path, run, capsys, monkeypatch):
    """``qkv export RUN --to ... . --overwrite`` from inside an earlier export: replacing the current
    folder would leave the shell in a deleted one (and once left an empty ``..old-*`` folder behind)."""
    needs("ctranslate2")
    earlier = fake_export(tmp_path / "ct2", "ctranslate2", {"model.bin": "w"})
    before = snapshot(earlier)
    monkeypatch.chdir(earlier)
    code, err = cli(capsys, "export", run, "--to", "ctranslate2", ".", "--overwrite")
    assert code == 2 and "holds the current directory" in err and "\n" not in err
    assert snapshot(earlier) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct2", "runs"]


def replaced_cleanly(folder: Path, kind: str) -> None:
    """``folder`` is a whole new export of ``kind``: exactly the files its marker lists, each 0644,
    and nothing left beside it (no temporary or moved-aside folder)."""
    marker = json.loads((folder / MARKER).read_text())
    assert marker["qkv_export"] == kind
    assert sorted(p.name for p in folder.iterdir()) == sorted([*marker["files"], MARKER])
    assert "stale.bin" not in marker["files"]
    for path in folder.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path.name
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith(".")] == []


# hf and onnx take several seconds to export on a small machine: slow (test_export_hf.py checks the
# marker and modes of the export its fixture makes anyway)
SLOW = pytest.mark.slow


@pytest.mark.parametrize("kind", [pytest.param("hf", marks=SLOW), "ctranslate2", pytest.param("onnx", marks=SLOW)])
def test_export_replaces_its_own_earlier_export(kind, tmp_path, run, capsys):
    """The positive case: an earlier export of the same format (here one whose list names a file the new
    one does not write) is replaced whole; the path is resolved first, so ``ct2/x/..`` is ``ct2``."""
    needs(kind)
    out = fake_export(tmp_path / "out", kind, {"stale.bin": "from the earlier export", "config.json": "{}"})
    code, err = cli(capsys, "export", run, "--to", kind, out / "x" / "..", "--overwrite")
    assert code == 0, err
    replaced_cleanly(out, kind)
    assert not (out / "x").exists()
    if kind == "hf":
        assert (out / "model.safetensors").is_file()  # 0644, as every file (replaced_cleanly)


# ------------------------------------------------------------------------------------------- qkv prepare
def write_corpus(folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    src, tgt = folder / "c.en", folder / "c.de"
    src.write_text("".join(f"a small house number {i}\n" for i in range(40)))
    tgt.write_text("".join(f"ein kleines haus nummer {i}\n" for i in range(40)))
    return src, tgt


def prepare(capsys, src: Path, tgt: Path, out: Path, *flags: str) -> tuple[int, str]:
    return cli(
        capsys, "prepare", "--train-src", src, "--train-tgt", tgt, "--out", out, "--vocab-size", 300,
        "--workers", 1, "--no-progress", *flags,
    )  # fmt: skip


def test_prepare_never_replaces_what_it_did_not_make(tmp_path, run, pretrained, user_folder, capsys):
    src, tgt = write_corpus(tmp_path / "text")
    earlier = tmp_path / "prep"
    assert prepare(capsys, src, tgt, earlier)[0] == 0
    mixed = shutil.copytree(earlier, tmp_path / "prep_mixed")
    (mixed / "notes.txt").write_text("mine")
    onnx_like = fake_export(tmp_path / "onnx", "onnx", {"manifest.json": json.dumps({"qkv_onnx": 1})})
    cases = {
        "a run": (run, "a run or model folder"),
        "a run's own prepared data": (run / "data", f"lies inside {run}"),
        "a pretrained model": (pretrained, "no manifest.json"),
        "a user's folder": (user_folder, "no manifest.json"),
        "an export with a manifest.json": (onnx_like, "its manifest.json is not a prepared folder's"),
        "a prepared folder holding a user's file": (mixed, "holds notes.txt"),
    }
    before = {name: snapshot(folder) for name, (folder, _) in cases.items()}
    for name, (folder, expected) in cases.items():
        code, err = prepare(capsys, src, tgt, folder, "--overwrite")
        assert code == 2 and "\n" not in err, (name, err)
        assert expected in err and "pass --overwrite" not in err, (name, err)
        assert snapshot(folder) == before[name], name
    assert "(no manifest.json)" not in prepare(capsys, src, tgt, onnx_like, "--overwrite")[1]
    code, err = prepare(capsys, src, tgt, earlier)  # without the flag, the one case it would accept
    assert code == 2 and "holds an earlier prepared folder; pass --overwrite" in err
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_prepare_replaces_its_own_earlier_folder(tmp_path, capsys):
    src, tgt = write_corpus(tmp_path / "text")
    out = tmp_path / "prep"
    assert prepare(capsys, src, tgt, out)[0] == 0
    (out / "verified.json").write_text("{}")  # the hash cache qkv keeps in a prepared folder
    first = json.loads((out / "manifest.json").read_text())
    src.write_text("".join(f"a big tree number {i}\n" for i in range(40)))
    code, err = prepare(capsys, src, tgt, out, "--overwrite")
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["fingerprint"] != first["fingerprint"]
    listed = {"manifest.json", "tokenizer.json", *manifest["splits"]["train"]["sha256"]}
    assert {p.name for p in out.iterdir()} == listed  # the old cache went with the old folder
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_the_shared_check_keeps_the_users_words(tmp_path):
    """Direct use of the runtime helper: a refusal names the folder the caller gave, as given."""
    folder = tmp_path / "x"
    folder.mkdir()
    (folder / "f").write_text("1")
    with pytest.raises(ValueError, match=r"x: not empty, and it is not mine; --overwrite replaces only an earlier"):
        check_output_folder(folder, overwrite=True, what="thing", own_files=lambda _: "it is not mine")
