"""Parallel text reading (plain, .gz, errors), Multi30k, the date task, and token batching."""

import datetime as dt
import gzip
import random
import shutil

import pytest
import torch

from qkv.data import make_batch, pad_sequences, read_lines, read_parallel, token_batches
from qkv.data.dates import FORMATS, format_date, generate_dates, is_held_out, ordinal_suffix, ordinal_word
from qkv.data.parallel import load_multi30k, multi30k_paths, resolve_multi30k
from qkv.data.sources import load_split, load_train_valid


def write(path, data: bytes):
    if str(path).endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


# --------------------------------------------------------------------------- reading files
@pytest.mark.parametrize("name", ["a.txt", "a.txt.gz"])
def test_read_lines_plain_and_gz(tmp_path, name):
    path = write(tmp_path / name, "Ein Hund läuft.\r\nZwei Männer 🙂\nlast line without newline".encode())
    assert read_lines(path) == ["Ein Hund läuft.", "Zwei Männer 🙂", "last line without newline"]


def test_read_parallel_aligned(tmp_path):
    src = write(tmp_path / "s.en", b"a dog\ntwo cats\n")
    tgt = write(tmp_path / "t.de.gz", b"ein Hund\nzwei Katzen\n")
    pairs = read_parallel(src, tgt)
    assert pairs.src == ["a dog", "two cats"] and pairs.tgt == ["ein Hund", "zwei Katzen"] and len(pairs) == 2


def test_misaligned_names_both_files_and_line(tmp_path):
    src = write(tmp_path / "s.en", b"one\ntwo\nthree\n")
    tgt = write(tmp_path / "t.de", b"eins\nzwei\n")
    with pytest.raises(ValueError) as err:
        read_parallel(src, tgt)
    message = str(err.value)
    assert "s.en" in message and "t.de" in message and "3 lines" in message and "line 3" in message


@pytest.mark.parametrize(
    "data, expected",
    [
        (b"", "file is empty"),
        (b"\n", "line 1: empty line"),
        (b"fine\n\nfine again\n", "line 2: empty line"),
        (b"ok\nstill ok\nbad \xff byte\n", "line 3: not valid UTF-8"),
        ("ok\n".encode("utf-16"), "line 1: not valid UTF-8"),
    ],
)
def test_bad_files_name_file_and_line(tmp_path, data, expected):
    path = write(tmp_path / "bad.txt", data)
    with pytest.raises(ValueError, match=expected) as err:
        read_lines(path)
    assert "bad.txt" in str(err.value)
    assert "\n" not in str(err.value)  # one line


def test_missing_and_fake_gz(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        read_lines(tmp_path / "nope.txt")
    fake = tmp_path / "fake.gz"
    fake.write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="fake.gz: cannot read"):
        read_lines(fake)


# --------------------------------------------------------------------------- Multi30k
def test_multi30k_loader_reads_the_data_qkv_finds(multi30k_dir):
    folder = multi30k_dir
    train = load_multi30k(folder, "train", "en", "de")
    val = load_multi30k(folder, "val", "en", "de")
    test = load_multi30k(folder, "test", "de", "en")
    assert (len(train), len(val), len(test)) == (29000, 1014, 1000)  # the table in the data README
    # independent read of the same files
    with gzip.open(folder / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        de = f.read().splitlines()
    with gzip.open(folder / "train.en.gz", "rt", encoding="utf-8") as f:
        en = f.read().splitlines()
    assert test.src == de and train.src == en
    assert multi30k_paths(folder, "test2016", "en", "fr")[1].name == "test_2016_flickr.fr.gz"
    with pytest.raises(ValueError, match="unknown Multi30k split"):
        load_multi30k(folder, "dev")


def test_resolve_multi30k_order(tmp_path, monkeypatch, multi30k_dir):
    monkeypatch.setenv("QKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("QKV_DATA", raising=False)
    with pytest.raises(FileNotFoundError, match="QKV_DATA"):
        resolve_multi30k(None, download=False)
    monkeypatch.setenv("QKV_DATA", str(multi30k_dir.parent))  # a folder holding multi30k/
    assert resolve_multi30k(None, download=False) == multi30k_dir
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "train.en").write_text("x\n")
    assert resolve_multi30k(plain, download=False) == plain  # an explicit folder comes first


def test_download_multi30k_writes_whole_files_or_none(tmp_path, monkeypatch):
    import io
    import urllib.request

    import qkv.data.parallel as parallel

    class Dropped(io.BytesIO):
        def read(self, *args):
            raise ConnectionResetError("connection reset by peer")

    def urlopen(url, timeout):
        name = url.rsplit("/", 1)[1]
        return Dropped() if name == "val.de.gz" else io.BytesIO(name.encode())

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    folder = tmp_path / "multi30k"
    with pytest.raises(FileNotFoundError) as err:
        parallel.download_multi30k(folder, langs=("en", "de"))
    assert "could not download Multi30k file" in str(err.value) and "val.de.gz" in str(err.value)
    assert "connection reset by peer" in str(err.value) and "\n" not in str(err.value)
    written = sorted(p.name for p in folder.iterdir())  # sorted stems: test_2016_flickr, train, val
    assert written == [
        "test_2016_flickr.de.gz",
        "test_2016_flickr.en.gz",
        "train.de.gz",
        "train.en.gz",
        "val.en.gz",
    ]  # the interrupted file is absent, and no temporary file is left
    assert (folder / "train.en.gz").read_bytes() == b"train.en.gz"
    assert oct((folder / "train.en.gz").stat().st_mode & 0o777) == oct(0o644)


def test_later_test_sets_come_from_the_cache_and_leave_the_data_folder_alone(tmp_path, monkeypatch, multi30k_dir):
    import io
    import urllib.request

    asked = []

    def urlopen(url, timeout):  # serves a two-line gzipped file named after the request
        asked.append(url.rsplit("/", 1)[1])
        return io.BytesIO(gzip.compress(f"{asked[-1]} one\n{asked[-1]} two\n".encode()))

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    monkeypatch.setenv("QKV_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "data"
    shutil.copytree(multi30k_dir, folder)
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(FileNotFoundError, match="test_2017_mscoco.en.gz"):
        load_multi30k(folder, "test_2017_mscoco", "en", "de")  # no download unless asked
    spec = {"source": "multi30k", "folder": str(folder), "src_lang": "en", "tgt_lang": "de"}
    coco = load_split(spec, "mscoco2017")
    assert coco.src == ["test_2017_mscoco.en.gz one", "test_2017_mscoco.en.gz two"]
    assert coco.tgt[1] == "test_2017_mscoco.de.gz two" and asked == ["test_2017_mscoco.en.gz", "test_2017_mscoco.de.gz"]
    assert load_multi30k(folder, "test_2017_mscoco", "en", "de").tgt == coco.tgt  # now read from the cache
    assert len(asked) == 2 and sorted(p.name for p in folder.iterdir()) == before
    assert sorted(p.name for p in (tmp_path / "cache" / "multi30k").iterdir()) == [
        "test_2017_mscoco.de.gz",
        "test_2017_mscoco.en.gz",
    ]
    with gzip.open(folder / "test_2018_flickr.de.gz", "wt", encoding="utf-8") as f:
        f.write("ein Hund\n")
    (folder / "test_2018_flickr.en").write_text("a dog\n", encoding="utf-8")
    assert load_split(spec, "test2018").src == ["a dog"] and len(asked) == 2  # the data folder's own copy first
    assert len(load_split(spec, "test")) == 1000 and len(asked) == 2  # test 2016 as before


def test_data_spec_multi30k_and_files(tmp_path, multi30k_dir):
    spec = {"source": "multi30k", "folder": str(multi30k_dir), "src_lang": "de", "tgt_lang": "en"}
    train, valid = load_train_valid(spec)
    assert len(train) == 29000 and len(valid) == 1014 and train.src_path.endswith("train.de.gz")
    assert len(load_split(spec, "test")) == 1000
    files = {
        "source": "files",
        "train_src": str(write(tmp_path / "a", b"x\ny\n")),
        "train_tgt": str(write(tmp_path / "b", b"X\nY\n")),
        "val_src": None,
        "val_tgt": None,
    }
    train, valid = load_train_valid(files)
    assert train.tgt == ["X", "Y"] and valid is None
    with pytest.raises(ValueError, match="no 'val' split"):
        load_split(files, "val")


# --------------------------------------------------------------------------- dates
STRPTIME = {  # an independent reading of the surface forms that the standard library can parse
    "Tuesday, 3 March 1998": "%A, %d %B %Y",
    "3 March 1998": "%d %B %Y",
    "March 3, 1998": "%B %d, %Y",
    "Tue 3 Mar 1998": "%a %d %b %Y",
    "Mar 3, 1998": "%b %d, %Y",
    "03-Mar-1998": "%d-%b-%Y",
    "TUESDAY, MARCH 3, 1998": "%A, %B %d, %Y",
    "march 3 1998": "%B %d %Y",
    "03/03/1998": "%m/%d/%Y",
    "3.3.1998": "%d.%m.%Y",
    "1998/03/03": "%Y/%m/%d",
    "19980303": "%Y%m%d",
}


def test_every_format_reads_back_to_its_date():
    rng = random.Random(1)
    for _ in range(300):
        date = dt.date.fromordinal(rng.randint(dt.date(1950, 1, 1).toordinal(), dt.date(2049, 12, 31).toordinal()))
        for name, fmt in STRPTIME.items():
            assert dt.datetime.strptime(format_date(date, name), fmt).date() == date, name
        # two-digit years: yy >= 50 -> 19yy, else 20yy
        century = 1900 if date.year % 100 >= 50 else 2000
        m, d, yy = format_date(date, "3/3/98").split("/")
        assert dt.date(century + int(yy), int(m), int(d)) == date
        d, m, yy = format_date(date, "03.03.98").split(".")
        assert dt.date(century + int(yy), int(m), int(d)) == date
        assert format_date(date, "3 Mar '98").endswith(f"'{date.year % 100:02d}")
    assert format_date(dt.date(1998, 3, 3), "the third of March, 1998") == "the third of March, 1998"
    assert format_date(dt.date(2001, 12, 21), "3rd of March 1998") == "21st of December 2001"


def test_ordinals():
    assert [ordinal_suffix(d) for d in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 30, 31)] == [
        "1st",
        "2nd",
        "3rd",
        "4th",
        "11th",
        "12th",
        "13th",
        "21st",
        "22nd",
        "23rd",
        "30th",
        "31st",
    ]
    assert [ordinal_word(d) for d in (1, 12, 20, 21, 29, 30, 31)] == [
        "first",
        "twelfth",
        "twentieth",
        "twenty-first",
        "twenty-ninth",
        "thirtieth",
        "thirty-first",
    ]
    with pytest.raises(ValueError, match="32"):
        ordinal_word(32)


def test_generate_dates_seeded_and_held_out_disjoint():
    a, b = generate_dates(500, seed=3), generate_dates(500, seed=3)
    assert a.src == b.src and a.tgt == b.tgt
    assert generate_dates(500, seed=4).src != a.src
    test = generate_dates(500, seed=3, split="test")
    assert not set(a.tgt) & set(test.tgt)
    assert all(is_held_out(dt.date.fromisoformat(t)) for t in test.tgt)
    assert all(dt.date.fromisoformat(t).isoformat() == t for t in a.tgt)
    # every format and every weekday occurs in both splits
    big_train, big_test = generate_dates(3000, seed=0), generate_dates(3000, seed=0, split="test")
    for pairs in (big_train, big_test):
        assert {dt.date.fromisoformat(t).weekday() for t in pairs.tgt} == set(range(7))
    assert len(FORMATS) >= 15
    with pytest.raises(ValueError, match="split"):
        generate_dates(3, split="dev")


# --------------------------------------------------------------------------- batching
def test_make_batch_frames_and_pads():
    batch = make_batch([[5, 6, 7], [8]], [[9], [10, 11]], pad_id=0, bos_id=1, eos_id=2)
    assert batch.src.tolist() == [[5, 6, 7, 2], [8, 2, 0, 0]]
    assert batch.tgt_in.tolist() == [[1, 9, 0], [1, 10, 11]]
    assert batch.tgt_out.tolist() == [[9, 2, 0], [10, 11, 2]]
    assert batch.num_tgt_tokens == 5
    assert pad_sequences([[1], [1, 2, 3]], 7).tolist() == [[1, 7, 7], [1, 2, 3]]
    with pytest.raises(ValueError):
        pad_sequences([], 0)


def test_token_batches_cover_everything_within_budget():
    rng = random.Random(0)
    src = [rng.randint(1, 40) for _ in range(1000)]
    tgt = [rng.randint(1, 40) for _ in range(1000)]
    src[7] = 500  # longer than the budget: a batch of its own
    batches = token_batches(src, tgt, 400, seed=1)
    assert sorted(i for b in batches for i in b) == list(range(1000))
    for b in batches:
        assert len(b) == 1 or len(b) * max(max(src[i], tgt[i]) for i in b) <= 400
    assert token_batches(src, tgt, 400, seed=1) == batches  # seeded
    other = token_batches(src, tgt, 400, seed=2)
    assert other != batches
    # length bucketing: padding is a small fraction of the padded tokens
    padded = sum(len(b) * max(max(src[i], tgt[i]) for i in b) for b in batches)
    real = sum(max(src[i], tgt[i]) for i in range(1000))
    assert real / padded > 0.85
    # evaluation order: deterministic and sorted by length
    fixed = token_batches(src, tgt, 400, seed=None)
    lengths = [max(src[i], tgt[i]) for b in fixed for i in b]
    assert lengths == sorted(lengths)
    with pytest.raises(ValueError, match="max_tokens"):
        token_batches(src, tgt, 0)


def test_batch_to_device_keeps_values():
    batch = make_batch([[5, 6]], [[7]], pad_id=0, bos_id=1, eos_id=2)
    moved = batch.to("cpu")
    assert torch.equal(moved.src, batch.src) and moved.num_tgt_tokens == batch.num_tgt_tokens
