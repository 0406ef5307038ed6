"""qkv.inference.generation: the one generator behind qkv generate and qkv serve gives
CausalLM.generate's tokens for the same seed (greedy and sampled, one sample or several), and both
commands cut a sample at its first stop text identically, as a plain search of the uncut text does."""

import io
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from qkv.cli import main
from qkv.inference import SamplingConfig, TextStream, generate_texts, open_run

LM_RUN = Path(__file__).parent / "fixtures" / "runs_v0_1" / "lm_run"


@pytest.fixture(scope="module")
def lm():
    model, tokenizer, _ = open_run(LM_RUN)
    return model, tokenizer


def reference(model, tokenizer, ids, samples, tokens, seed, **options):
    """The continuation CausalLM.generate gives, decoded: what a generator must reproduce."""
    batch = torch.tensor([ids] * samples)
    out = model.generate(batch, tokens, generator=torch.Generator().manual_seed(seed), **options)
    return [tokenizer.decode(row[len(ids) :].tolist()) for row in out]


@pytest.mark.parametrize("options", [dict(temperature=0), dict(temperature=1.0), dict(top_k=5, top_p=0.9)])
@pytest.mark.parametrize("samples", [1, 3])
def test_the_generator_gives_generate_s_tokens(lm, options, samples):
    model, tokenizer = lm
    ids = tokenizer.encode("ROMEO:")
    pieces: dict[int, list[str]] = {row: [] for row in range(samples)}
    got = generate_texts(
        model,
        tokenizer,
        ids,
        SamplingConfig(40, **options),
        samples=samples,
        generator=torch.Generator().manual_seed(7),
        on_text=lambda row, text: pieces[row].append(text),
    )
    expected = reference(model, tokenizer, ids, samples, 40, seed=7, **options)
    assert [c.text for c in got] == expected
    assert [c.tokens for c in got] == [40] * samples and {c.finish_reason for c in got} == {"length"}
    assert ["".join(pieces[row]) for row in range(samples)] == expected  # the streamed pieces add up
    if samples == 3 and options.get("temperature") != 0:
        assert len(set(expected)) > 1  # sampled rows differ: the seed is not only replayed row by row


def first_stop_cut(text: str, stops: list[str]) -> str:
    cuts = [text.find(s) for s in stops if s in text]
    return text[: min(cuts)] if cuts else text


def test_stop_texts_cut_identically_in_the_cli_and_the_server(lm, capsys):
    from qkv.inference.continuous import ContinuousBatch, GenerationRequest

    model, tokenizer = lm
    ids = tokenizer.encode("\n")
    full = reference(model, tokenizer, ids, 1, 120, seed=3)[0]
    stops = sorted({full[10:12], full[30:33]})  # texts that do occur, the first well inside
    expected = first_stop_cut(full, stops)
    assert expected != full and len(expected) >= 10

    options = ["--prompt", "\n", "--max-new-tokens", "120", "--seed", "3", "--threads", "1", "--device", "cpu"]
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["generate", str(LM_RUN), *options, *(f"--stop={s}" for s in stops)]) == 0
    assert out.getvalue() == "\n" + expected + "\n"

    pieces: list[str] = []
    batch = ContinuousBatch(model.eval(), tokenizer)  # the server's path (qkv.serve.generation)
    sampling = SamplingConfig(120, 1.0, stop=stops)
    member = batch.add(GenerationRequest(ids, sampling, seed=3, on_text=pieces.append))
    while batch:
        batch.step()
    assert member.result is not None and member.result.text == expected and "".join(pieces) == expected
    assert member.result.finish_reason == "stop"
    for piece in pieces:  # nothing of a stop text was ever sent
        assert not any(s in piece for s in stops)


def test_a_text_stream_holds_back_what_could_become_a_stop_text():
    class Letters:
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    stream = TextStream(Letters(), ["END"])
    sent = [stream.add(ord(c)) for c in "abcEN"]
    assert "".join(sent) == "abc" and not stream.done  # "EN" may still become END
    assert stream.add(ord("D")) == "" and stream.done and stream.text == "abc"
    other = TextStream(Letters(), ["END"])
    assert "".join(other.add(ord(c)) for c in "abENx") + other.settled(final=True) == "abENx"


def test_a_stop_text_must_not_be_empty():
    with pytest.raises(ValueError, match="--stop needs a non-empty text"):
        SamplingConfig(10, stop=("",))
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(10, temperature=1e-40)
