"""DataSpec: the typed form of config.json's "data" object. It must read every object qkv has
written there and write back exactly the same object, so run folders of any version resume."""

import json
from pathlib import Path

import pytest

from qkv.data.sources import check_spec, describe
from qkv.data.spec import DataSpec, as_spec
from qkv.data.text import check_text_spec

FIXTURES = Path(__file__).parent / "fixtures" / "runs_v0_1"

# the objects `qkv train` writes, one per source (as its _source_spec builds them)
WRITTEN = [
    {"source": "multi30k", "folder": None, "src_lang": "en", "tgt_lang": "de"},
    {"source": "multi30k", "folder": "/data/multi30k", "src_lang": "de", "tgt_lang": "en", "both_directions": True},
    {"source": "files", "train_src": "/a.en", "train_tgt": "/a.de", "val_src": None, "val_tgt": None},
    {"source": "files", "train_src": "/a.en", "train_tgt": "/a.de", "val_src": "/v.en", "val_tgt": "/v.de"},
    {"source": "dates", "train_size": 20000, "valid_size": 1000, "seed": 3},
    {"source": "prepared", "folder": "/data/wmt14"},
    {"source": "tinyshakespeare", "folder": None},
    {"source": "text", "train_text": "/t.txt", "val_text": "/v.txt", "test_text": None},
]


@pytest.mark.parametrize("data", WRITTEN, ids=lambda d: d["source"])
def test_what_qkv_writes_reads_back_unchanged(data):
    spec = DataSpec.from_json(data)
    assert spec.to_json() == data
    assert list(spec.to_json()) == list(data)  # the same order of keys, as config.json shows them
    assert json.loads(json.dumps(spec.to_json())) == data


@pytest.mark.parametrize("run", ["translation_run", "lm_run"])
def test_the_0_1_run_folders_data_reads_back_unchanged(run):
    data = json.loads((FIXTURES / run / "config.json").read_text(encoding="utf-8"))["data"]
    assert DataSpec.from_json(data).to_json() == data


def test_a_field_left_out_means_what_qkv_has_always_read_it_as():
    # load_train_valid and describe read a missing language as en -> de, a missing size as these
    assert DataSpec.from_json({"source": "multi30k"}) == DataSpec(source="multi30k", src_lang="en", tgt_lang="de")
    dates = DataSpec.from_json({"source": "dates"})
    assert (dates.train_size, dates.valid_size, dates.seed) == (20000, 500, 0)
    text = DataSpec.from_json({"source": "text", "train_text": "/t.txt"})
    assert text.to_json() == {"source": "text", "train_text": "/t.txt", "val_text": None, "test_text": None}


def test_a_path_is_kept_as_text():
    spec = DataSpec(source="files", train_src=Path("/a.en"), train_tgt=Path("/a.de"))
    assert spec.train_src == "/a.en" and json.dumps(spec.to_json())


@pytest.mark.parametrize(
    "data, message",
    [
        ({"source": "files", "train_src": "a", "train_tgt": "b", "max_lines": 3}, "no field 'max_lines'"),
        ({"train_src": "a"}, "unknown data source None"),
        (["multi30k"], "JSON object"),
    ],
)
def test_what_no_qkv_wrote_is_refused_naming_it(data, message):
    with pytest.raises(ValueError, match=message):
        DataSpec.from_json(data)


def test_the_checks_refuse_a_field_the_source_does_not_read():
    with pytest.raises(ValueError, match="does not read train_text"):
        check_spec(DataSpec(source="dates", train_text="/t.txt"))
    with pytest.raises(ValueError, match="does not read src_lang"):
        check_text_spec(DataSpec(source="text", train_text="/t.txt", src_lang="en"))
    # tiny Shakespeare with a validation file keeps its own, older message
    with pytest.raises(ValueError, match="tiny Shakespeare is cut by position"):
        check_text_spec(DataSpec(source="tinyshakespeare", val_text="/v.txt"))


def test_input_files_are_the_files_and_folders_a_run_reads():
    assert DataSpec.from_json(WRITTEN[3]).input_files() == ["/a.en", "/a.de", "/v.en", "/v.de"]
    assert DataSpec.from_json(WRITTEN[5]).input_files() == ["/data/wmt14"]
    assert DataSpec.from_json(WRITTEN[1]).input_files() == ["/data/multi30k"]
    assert DataSpec.from_json(WRITTEN[4]).input_files() == []
    assert DataSpec.from_json(WRITTEN[7]).input_files() == ["/t.txt", "/v.txt"]


def test_readers_take_config_json_objects_and_describe_reads_the_spec():
    assert as_spec(WRITTEN[1]) == DataSpec.from_json(WRITTEN[1])
    assert describe(DataSpec.from_json(WRITTEN[1])) == "Multi30k de->en and back (both directions)"
    assert describe(DataSpec.from_json(WRITTEN[2])) == "a.en -> a.de"


def test_start_run_takes_a_data_spec_and_says_how_to_make_one_from_a_dict(tmp_path):
    from qkv.runs.translation import start_run

    with pytest.raises(TypeError, match="DataSpec.from_json"):
        start_run(tmp_path / "run", data={"source": "dates"})
    assert not (tmp_path / "run").exists()
