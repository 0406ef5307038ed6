"""A prepared folder is what its manifest says, or training refuses it: through ``qkv.cli.main``,
each damage a hostile user tried (every target id 7, every source id 5, every offset 2**40, an id
past the vocabulary, an array changed under a run that then resumes) is one line naming the file,
exit 2, and nothing written. The hashes are kept in the folder's ``verified.json`` and used while
the files are unchanged (counted by replacing the hash function, never timed).
"""

import json
import os
import shutil

import numpy as np
import pytest
from test_reliability import one_line_error, snapshot

from qkv.cli import main
from qkv.data.dates import generate_dates
from qkv.data.prepared import CACHE_FILE, PreparedCorpus, folder_fingerprint, split_files
from qkv.data.prepared import integrity as prepared_module
from qkv.data.prepared.preparing import prepare_corpus

MODEL = [
    "--d-model",
    "32",
    "--heads",
    "2",
    "--encoder-layers",
    "1",
    "--decoder-layers",
    "1",
    "--d-ff",
    "64",
    "--max-tokens",
    "600",
    "--no-progress",
    "--threads",
    "1",
    "--no-bf16",
    "--minutes",
    "0",
]
HOUR_NS = 3600 * 10**9


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A prepared folder of 120 generated date pairs (train) and 20 (valid), a 300-id vocabulary."""
    root = tmp_path_factory.mktemp("integrity")
    files = {}
    for name, pairs in (("train", generate_dates(120, seed=3)), ("valid", generate_dates(20, seed=4))):
        for side, lines in (("src", pairs.src), ("tgt", pairs.tgt)):
            files[name, side] = root / f"{name}.{side}"
            files[name, side].write_text("\n".join(lines) + "\n", encoding="utf-8")
    prepare_corpus(
        files["train", "src"],
        files["train", "tgt"],
        root / "prep",
        val_src=files["valid", "src"],
        val_tgt=files["valid", "tgt"],
        vocab_size=300,
        workers=1,
        progress=False,
    )
    return root / "prep"


@pytest.fixture
def folder(pristine, tmp_path):
    """A copy of the pristine folder, free to damage."""
    return shutil.copytree(pristine, tmp_path / "prep")


def overwrite(path, dtype, value, where=slice(None)):
    """Set ``where`` of the array file ``path`` to ``value`` in place, as a user with numpy would."""
    array = np.memmap(path, dtype=dtype, mode="r+")
    array[where] = value
    array.flush()
    del array


def ids_dtype(folder):
    return json.loads((folder / "manifest.json").read_text(encoding="utf-8"))["ids_dtype"]


def train(capsys, folder, run_dir, *extra):
    capsys.readouterr()
    return main(["train", "--prepared", str(folder), "--run-dir", str(run_dir), "--max-steps", "1", *MODEL, *extra])


def refused(capsys, code, file, *expected):
    """The one-line error names ``file`` and says each of ``expected``."""
    line = one_line_error(capsys, "train", code)
    assert f"{file}: " in line, line
    for text in expected:
        assert text in line, line
    return line


# ----------------------------------------------------------------- the damage found, at the start of a run
def test_a_clean_folder_trains(folder, tmp_path, capsys):
    assert train(capsys, folder, tmp_path / "run") == 0


@pytest.mark.parametrize(
    "damage, file, expected",
    [
        ("every target id 7", "train.tgt.bin", ["changed since it was prepared", "SHA-256"]),
        ("every source id 5", "train.src.bin", ["changed since it was prepared", "SHA-256"]),
        ("every source offset 2**40", "train.src.idx", ["the first offset is 1099511627776, not 0"]),
        ("an id past the vocabulary", "train.tgt.bin", ["is outside the vocabulary of", "position 3, pair 0"]),
        ("the vocabulary's own size as an id", "valid.src.bin", ["is outside the vocabulary of"]),
        ("offsets that go back", "train.tgt.idx", ["the offsets go back at pair 4"]),
        ("a length table that disagrees", "train.len", ["pair 7's tgt length is 999", "train.tgt.idx"]),
        ("a changed tokenizer", "tokenizer.json", ["changed since it was prepared"]),
        ("a manifest whose hash was edited", "manifest.json", ["fingerprint is not that of the hashes"]),
    ],
)
def test_damage_refuses_a_run_naming_the_file(folder, tmp_path, capsys, damage, file, expected):
    vocab = PreparedCorpus(folder).manifest["vocab_size"]
    dtype = ids_dtype(folder)
    if damage == "every target id 7":
        overwrite(folder / file, dtype, 7)
    elif damage == "every source id 5":
        overwrite(folder / file, dtype, 5)
    elif damage == "every source offset 2**40":
        overwrite(folder / file, np.int64, 2**40)
    elif damage == "an id past the vocabulary":
        overwrite(folder / file, dtype, 65535, 3)
    elif damage == "the vocabulary's own size as an id":
        overwrite(folder / file, dtype, vocab, 0)
    elif damage == "offsets that go back":
        offsets = np.fromfile(folder / file, dtype=np.int64)
        overwrite(folder / file, np.int64, offsets[4] - 1, 5)
    elif damage == "a length table that disagrees":
        overwrite(
            folder / file, PreparedCorpus(folder).manifest["splits"]["train"]["lengths_dtype"], 999, 2 * 7 + 1
        )  # row 7, the target column
    elif damage == "a changed tokenizer":
        (folder / file).write_bytes((folder / file).read_bytes() + b" ")
    else:
        manifest = json.loads((folder / file).read_text(encoding="utf-8"))
        manifest["splits"]["train"]["sha256"]["train.tgt.bin"] = "0" * 64
        (folder / file).write_text(json.dumps(manifest), encoding="utf-8")
    before = snapshot(tmp_path)
    refused(capsys, train(capsys, folder, tmp_path / "run"), folder / file, *expected)
    after = snapshot(tmp_path)
    after.pop(f"prep/{CACHE_FILE}", None)  # the hashes of the files that are right may be kept
    assert after == before  # no run folder, and the prepared folder as it was


def test_checks_read_the_arrays_a_window_at_a_time(folder, monkeypatch):
    """With 7-element windows the clean folder still passes (no false alarm at a window's edge),
    and an id far into the array is found at its position and pair."""
    monkeypatch.setattr(prepared_module, "SCAN_ITEMS", 7)
    PreparedCorpus(folder).verify(cache=False)
    offsets = np.fromfile(folder / "train.src.idx", dtype=np.int64)
    position = int(offsets[50]) + 1  # the second id of pair 50, many windows in
    overwrite(folder / "train.src.bin", ids_dtype(folder), 60000, position)
    with pytest.raises(ValueError, match=rf"train\.src\.bin: id 60000 \(position {position}, pair 50\)"):
        PreparedCorpus(folder).verify(cache=False)


def test_ids_are_checked_against_the_models_vocabulary_too(folder):
    """verify(vocab_size) takes the smaller of the manifest's vocabulary and the model's."""
    corpus = PreparedCorpus(folder)
    top = int(max(corpus.split(split).tokens(side).max() for split in ("train", "valid") for side in ("src", "tgt")))
    PreparedCorpus(folder).verify(top + 1, cache=False)
    with pytest.raises(ValueError, match=rf"train\.(src|tgt)\.bin: id {top} .* vocabulary of {top} ids"):
        PreparedCorpus(folder).verify(top, cache=False)


def test_a_damaged_manifest_field_is_named(folder, capsys, tmp_path):
    manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    manifest["splits"]["train"]["lengths_dtype"] = "object"
    (folder / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    refused(capsys, train(capsys, folder, tmp_path / "run"), folder / "manifest.json", "splits.train.lengths_dtype")


# ----------------------------------------------------------------- resuming
def test_resume_refuses_an_array_changed_since_the_run_started(folder, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(capsys, folder, run) == 0
    overwrite(folder / "train.tgt.bin", ids_dtype(folder), 7)
    before = snapshot(run)
    capsys.readouterr()
    code = main(["train", "--run-dir", str(run), "--resume", "--max-steps", "2", "--no-progress"])
    refused(capsys, code, folder / "train.tgt.bin", "changed since it was prepared", "resuming would not continue")
    assert snapshot(run) == before


def forge(folder, file, dtype, value):
    """Damage ``file`` and rewrite the manifest to match it (its hash and the fingerprint), as a
    careless tool might: the folder is self-consistent, but not the data a run started on."""
    overwrite(folder / file, dtype, value)
    manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    split = file.split(".")[0]
    manifest["splits"][split]["sha256"][file] = prepared_module.sha256_file(folder / file)
    manifest["fingerprint"] = folder_fingerprint(manifest["tokenizer_sha256"], manifest["splits"])
    (folder / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")


def test_resume_refuses_a_folder_rewritten_to_match_its_manifest(folder, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(capsys, folder, run) == 0
    forge(folder, "train.tgt.bin", ids_dtype(folder), 7)
    PreparedCorpus(folder).verify(cache=False)  # consistent in itself
    capsys.readouterr()
    code = main(["train", "--run-dir", str(run), "--resume", "--max-steps", "2", "--no-progress"])
    assert "changed since this run started" in one_line_error(capsys, "train", code)


def test_resume_refuses_a_changed_copy_of_the_pairs_in_the_run_folder(tmp_path, capsys):
    """A run on text files keeps its pairs in run/data, fingerprinted in config.json: a damaged
    array there, or the copy rewritten to match its manifest, refuses the resume."""
    pairs = generate_dates(80, seed=5)
    for side, lines in (("src", pairs.src), ("tgt", pairs.tgt)):
        (tmp_path / f"train.{side}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    run = tmp_path / "run"
    capsys.readouterr()
    assert (
        main(
            [
                "train",
                "--train-src",
                str(tmp_path / "train.src"),
                "--train-tgt",
                str(tmp_path / "train.tgt"),
                "--run-dir",
                str(run),
                "--max-steps",
                "1",
                "--vocab-size",
                "300",
                *MODEL,
            ]
        )
        == 0
    )
    config = json.loads((run / "config.json").read_text(encoding="utf-8"))
    assert config["prepared"] == {"folder": "data", "fingerprint": PreparedCorpus(run / "data").fingerprint}
    resume = ["train", "--run-dir", str(run), "--resume", "--max-steps", "2", "--no-progress"]
    shutil.copytree(run / "data", tmp_path / "data_kept")

    overwrite(run / "data" / "train.src.bin", ids_dtype(run / "data"), 5)
    before = snapshot(run)
    capsys.readouterr()
    refused(capsys, main(resume), run / "data" / "train.src.bin", "changed since it was prepared")
    assert snapshot(run) == before and not (run / "data" / CACHE_FILE).exists()

    shutil.rmtree(run / "data")
    shutil.copytree(tmp_path / "data_kept", run / "data")
    forge(run / "data", "train.src.bin", ids_dtype(run / "data"), 5)
    capsys.readouterr()
    assert "changed since this run started" in one_line_error(capsys, "train", main(resume))


# ----------------------------------------------------------------- the hash cache
def age(folder, seconds=3600):
    """Set every file's mtime back (the folder was prepared a while ago): hashes are kept only for
    files not changed in the last moments (see HashCache)."""
    for path in folder.iterdir():
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns - seconds * 10**9))


@pytest.fixture
def hashed(monkeypatch):
    """The names of the files hashed, in order (the hash function replaced by a counting one)."""
    names, real = [], prepared_module.sha256_file

    def counting(path):
        names.append(path.name)
        return real(path)

    monkeypatch.setattr(prepared_module, "sha256_file", counting)
    return names


def all_files(folder):
    manifest = PreparedCorpus(folder).manifest
    return sorted(["tokenizer.json"] + [f for split in manifest["splits"] for f in split_files(split)])


def test_a_second_open_uses_the_kept_hashes(folder, hashed):
    age(folder)
    PreparedCorpus(folder).verify()
    assert sorted(hashed) == all_files(folder) and (folder / CACHE_FILE).is_file()
    hashed.clear()
    PreparedCorpus(folder).verify()
    assert hashed == []


def test_a_changed_file_is_hashed_again(folder, hashed):
    age(folder)
    PreparedCorpus(folder).verify()
    hashed.clear()
    path = folder / "train.tgt.bin"
    mtime = path.stat().st_mtime_ns
    path.write_bytes(path.read_bytes())  # the same bytes, rewritten, and the mtime set back as it was:
    os.utime(path, ns=(mtime, mtime))  # the ctime moved, so the kept hash no longer counts
    PreparedCorpus(folder).verify()
    assert hashed == ["train.tgt.bin"]
    hashed.clear()
    overwrite(path, ids_dtype(folder), 7)
    os.utime(path, ns=(mtime, mtime))
    with pytest.raises(ValueError, match=r"train\.tgt\.bin: changed since it was prepared"):
        PreparedCorpus(folder).verify()
    assert hashed == ["train.tgt.bin"]


def test_files_changed_just_now_get_no_kept_hash(folder, hashed):
    """A folder written a moment ago (a coarse filesystem clock could hide a second change in the
    same tick), or dated in the future, is hashed each time."""
    age(folder, -3600)
    PreparedCorpus(folder).verify()
    PreparedCorpus(folder).verify()
    assert sorted(hashed) == sorted(2 * all_files(folder)) and not (folder / CACHE_FILE).exists()


def test_a_kept_hash_never_condemns_a_file(folder, hashed):
    """A cache entry that disagrees with the manifest (however it came to) means hashing again,
    and a damaged cache is ignored; neither is an error."""
    age(folder)
    PreparedCorpus(folder).verify()
    cache = json.loads((folder / CACHE_FILE).read_text(encoding="utf-8"))
    cache["files"]["train.src.idx"]["sha256"] = "f" * 64
    (folder / CACHE_FILE).write_text(json.dumps(cache), encoding="utf-8")
    hashed.clear()
    PreparedCorpus(folder).verify()
    assert hashed == ["train.src.idx"]
    (folder / CACHE_FILE).write_bytes(b'{"format": 1, "files": [')
    PreparedCorpus(folder).verify()


def test_a_folder_that_cannot_be_written_keeps_no_hashes(folder, hashed, monkeypatch):
    def refuse(path, *args, **kwargs):
        raise PermissionError(f"{path}: read-only")

    monkeypatch.setattr(prepared_module, "write_json", refuse)
    age(folder)
    PreparedCorpus(folder).verify()
    PreparedCorpus(folder).verify()
    assert sorted(hashed) == sorted(2 * all_files(folder))


# ----------------------------------------------------------------- a forged hash cache
def flip_a_byte(path):
    """Change the first byte of ``path`` in place (its lowest bit: an id stays an id of the same
    vocabulary, so only the hash can tell), as a user with a hex editor would."""
    with open(path, "r+b") as handle:
        first = handle.read(1)[0]
        handle.seek(0)
        handle.write(bytes([first ^ 1]))


def forge_cache(folder, file):
    """Write ``file``'s size, inode, mtime and ctime as they are now into ``verified.json``, with
    the manifest's hash: the cache claims the changed file was verified. Returns the entry."""
    manifest = PreparedCorpus(folder).manifest
    stat = (folder / file).stat()
    entry = {
        "size": stat.st_size,
        "ino": stat.st_ino,
        "mtime_ns": stat.st_mtime_ns,
        "ctime_ns": stat.st_ctime_ns,
        "sha256": manifest["splits"][file.split(".")[0]]["sha256"][file],
    }
    cache = json.loads((folder / CACHE_FILE).read_text(encoding="utf-8"))
    cache["files"][file] = entry
    (folder / CACHE_FILE).write_text(json.dumps(cache), encoding="utf-8")
    return entry


def resume(capsys, run):
    capsys.readouterr()
    return main(["train", "--run-dir", str(run), "--resume", "--max-steps", "2", "--no-progress"])


def test_a_forged_hash_cache_does_not_pass_a_changed_array_on_resume(folder, tmp_path, capsys, hashed):
    """The run starts on the clean folder (its hashes kept); then one byte of an array changes and
    verified.json is given the changed file's new size, inode, mtime and ctime beside the
    manifest's hash. A start trusts the cache, so the forgery is real; the resume hashes the
    contents and refuses in one line naming the array, writing nothing into the run."""
    age(folder)
    run = tmp_path / "run"
    assert train(capsys, folder, run) == 0
    original = (folder / "train.tgt.bin").read_bytes()
    flip_a_byte(folder / "train.tgt.bin")
    assert (folder / "train.tgt.bin").read_bytes() != original
    forge_cache(folder, "train.tgt.bin")
    hashed.clear()
    PreparedCorpus(folder).verify()  # the premise: the forged entry is one a trusting check accepts
    assert "train.tgt.bin" not in hashed
    before = snapshot(run)
    line = refused(
        capsys,
        resume(capsys, run),
        folder / "train.tgt.bin",
        "changed since it was prepared",
        "resuming would not continue",
    )
    assert line.count(str(folder / "train.tgt.bin")) == 1
    assert snapshot(run) == before
    # the resume dropped the forged entry: a new run on the folder now hashes the file and refuses it
    assert "train.tgt.bin" not in json.loads((folder / CACHE_FILE).read_text(encoding="utf-8"))["files"]
    refused(capsys, train(capsys, folder, tmp_path / "another"), folder / "train.tgt.bin", "changed since")


def test_a_run_started_on_a_forged_cache_is_refused_at_its_first_resume(folder, tmp_path, capsys):
    """A first start trusts verified.json (by design: it spares hashing gigabytes at every start),
    so a forged entry lets a changed array train; but the run records the manifest's fingerprint,
    that of the data as prepared, so its first resume hashes the array and refuses it."""
    age(folder)
    PreparedCorpus(folder).verify()  # the hashes kept, as any earlier run would leave them
    flip_a_byte(folder / "train.src.bin")
    forge_cache(folder, "train.src.bin")
    run = tmp_path / "run"
    assert train(capsys, folder, run) == 0  # trusted: what verified.json vouches for is not hashed
    config = json.loads((run / "config.json").read_text(encoding="utf-8"))
    assert config["prepared"]["fingerprint"] == PreparedCorpus(folder).manifest["fingerprint"]
    refused(capsys, resume(capsys, run), folder / "train.src.bin", "changed since it was prepared")


def test_an_unchanged_folder_resumes_hashing_every_file(folder, tmp_path, capsys, hashed):
    """A resume hashes every file from its contents even while verified.json vouches for them all,
    and leaves verified.json as it was (the hashes found are those kept): the next start hashes
    nothing."""
    age(folder)
    run = tmp_path / "run"
    assert train(capsys, folder, run) == 0
    hashed.clear()
    PreparedCorpus(folder).verify()
    assert hashed == []  # the premise: every file's hash is kept and counts
    kept = (folder / CACHE_FILE).stat()
    assert resume(capsys, run) == 0
    assert sorted(hashed) == all_files(folder)
    now = (folder / CACHE_FILE).stat()
    assert (now.st_ino, now.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)
    hashed.clear()
    PreparedCorpus(folder).verify()
    assert hashed == []


def test_a_forged_cache_in_the_runs_own_copy_is_never_read(tmp_path, capsys):
    """A run on text keeps its pairs in run/data and no hash cache there: a verified.json put there,
    vouching for a changed array, is not read by the resume, which refuses the array."""
    src, tgt = tmp_path / "train.src", tmp_path / "train.tgt"
    pairs = generate_dates(80, seed=6)
    src.write_text("\n".join(pairs.src) + "\n", encoding="utf-8")
    tgt.write_text("\n".join(pairs.tgt) + "\n", encoding="utf-8")
    run = tmp_path / "run"
    capsys.readouterr()
    start = ["train", "--train-src", str(src), "--train-tgt", str(tgt), "--run-dir", str(run), "--vocab-size", "300"]
    assert main([*start, "--max-steps", "1", *MODEL]) == 0
    data = run / "data"
    flip_a_byte(data / "train.tgt.bin")
    (data / CACHE_FILE).write_text(json.dumps({"format": 1, "files": {}}), encoding="utf-8")
    forge_cache(data, "train.tgt.bin")
    refused(capsys, resume(capsys, run), data / "train.tgt.bin", "changed since it was prepared")


def test_check_hashes_without_trust_hashes_a_file_the_cache_vouches_for(folder, hashed):
    """The function the resume uses: with trust_cache=False a valid entry spares nothing, and a
    forged one neither passes the file nor stays in verified.json."""
    age(folder)
    PreparedCorpus(folder).verify()
    hashed.clear()
    PreparedCorpus(folder).verify(trust_cache=False)
    assert sorted(hashed) == all_files(folder)
    flip_a_byte(folder / "valid.lines")
    stat = (folder / "valid.lines").stat()
    os.utime(folder / "valid.lines", ns=(stat.st_atime_ns, stat.st_mtime_ns - HOUR_NS))  # not racy
    entry = forge_cache(folder, "valid.lines")
    PreparedCorpus(folder).verify()  # trusted
    with pytest.raises(ValueError, match=r"valid\.lines: changed since it was prepared"):
        PreparedCorpus(folder).verify(trust_cache=False)
    kept = json.loads((folder / CACHE_FILE).read_text(encoding="utf-8"))["files"]["valid.lines"]
    assert kept["sha256"] == prepared_module.sha256_file(folder / "valid.lines") != entry["sha256"]
