"""Continuous batching (qkv.inference.continuous): members that join a running batch at different
steps, with prompts of different lengths, each get what generating alone gives: the logits of every
step within float32 rounding of the model run on that member's sequence by itself, and the same tokens
as qkv.inference.generation.generate_texts (CausalLM.generate) with the same seed, greedy or sampled,
for learned positions, rotary + grouped-query + a window + QK-norm, ALiBi with one key/value head,
and sequences that run past the context. The reference for each member is the model run alone on it,
without the cache's per-row positions."""

from __future__ import annotations

import pytest
import torch

from qkv.attention.multihead import KVCache
from qkv.inference.continuous import ContinuousBatch, GenerationRequest
from qkv.inference.generation import SamplingConfig, generate_texts
from qkv.models.causal_lm import CausalLM, CausalLMConfig

VARIANTS = {
    "gpt2": {},
    "rotary-gqa-window": {"positional": "rotary", "num_kv_heads": 2, "sliding_window": 5, "qk_norm": True},
    "alibi-mqa-rms": {"positional": "alibi", "num_kv_heads": 1, "norm": "rms", "activation": "swiglu"},
    "sinusoidal-window-layers": {"positional": "sinusoidal", "sliding_window": 4, "sliding_window_layers": [1]},
}


class Letters:
    """A tokenizer for the tests: id i is the letter ``chr(97 + i % 26)``."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def make_model(context: int = 64, **options: object) -> CausalLM:
    torch.manual_seed(0)
    config = CausalLMConfig(
        vocab_size=40, d_model=32, num_heads=4, num_layers=2, d_ff=64, context=context, dropout=0.0, **options
    )
    return CausalLM(config).eval()


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 40, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def alone(model, prompt, sampling, seed):
    generator = torch.Generator().manual_seed(seed)
    return generate_texts(model, Letters(), prompt, sampling, generator=generator)[0]


def run_batch(batch: ContinuousBatch, requests, join_at):
    """Add request i at step join_at[i]; step until every member has left."""
    members, step = {}, 0
    while len(members) < len(requests) or batch:
        for i, request in enumerate(requests):
            if join_at[i] == step and i not in members:
                members[i] = batch.add(request)
        batch.step()
        step += 1
        assert step < 500
    return [members[i] for i in range(len(requests))]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_members_that_join_late_get_the_tokens_of_generating_alone(variant, temperature):
    model = make_model(**VARIANTS[variant])
    texts = prompts(7)
    sampling = [SamplingConfig(6 + 3 * i, temperature, top_k=20 if i % 2 else None) for i in range(7)]
    requests = [GenerationRequest(p, s, seed=100 + i) for i, (p, s) in enumerate(zip(texts, sampling))]
    members = run_batch(ContinuousBatch(model, Letters(), max_rows=4), requests, [0, 0, 1, 3, 3, 4, 9])
    for i, member in enumerate(members):
        expected = alone(model, texts[i], sampling[i], 100 + i)
        assert member.result == expected, f"member {i}"


def test_stop_texts_and_the_pieces_add_up():
    model = make_model()
    greedy = alone(model, [3, 4, 5], SamplingConfig(20, 0.0), 0).text
    stop = greedy[6:8]
    pieces: list[str] = []
    request = GenerationRequest([3, 4, 5], SamplingConfig(20, 0.0, stop=[stop]), on_text=pieces.append)
    other = GenerationRequest([7], SamplingConfig(30, 0.0))
    first, _ = run_batch(ContinuousBatch(model, Letters()), [request, other], [0, 0])
    assert first.result.text == greedy[: greedy.find(stop)] == "".join(pieces)
    assert first.result.finish_reason == "stop"


@pytest.mark.parametrize("variant", ["gpt2", "rotary-gqa-window", "alibi-mqa-rms"])
def test_each_step_s_logits_equal_the_model_run_alone(variant):
    """The batched step's logits of each row against the whole sequence run alone (no cache at all)."""
    model = make_model(**VARIANTS[variant])
    batch = ContinuousBatch(model, Letters(), max_rows=8)
    greedy = [GenerationRequest(p, SamplingConfig(40, 0.0), logprobs=True) for p in prompts(5, seed=4)]
    batch.add(greedy[0])
    batch.step()
    for request in greedy[1:]:
        batch.add(request)
        batch.step()
    checked = 0
    with torch.no_grad():
        for _ in range(6):
            ids = torch.tensor([[m.ids[-1]] for m in batch.members])
            stepped = model(ids, cache=batch.cache).logits[:, -1]
            for row, member in enumerate(batch.members):
                whole = model(torch.tensor([member.ids])).logits[0, -1]
                torch.testing.assert_close(stepped[row], whole, atol=1e-5, rtol=1e-5)
                checked += 1
            batch.step()
    assert checked == 30
    for member in batch.members:  # the logprobs recorded: the model's own log-softmax at each chosen token
        with torch.no_grad():
            logits = model(torch.tensor([member.ids[:-1]])).logits[0]
        chosen = torch.log_softmax(logits, -1)[torch.arange(len(member.ids) - 1), torch.tensor(member.ids[1:])]
        n = len(member.logprobs)
        torch.testing.assert_close(torch.tensor(member.logprobs), chosen[-n:], atol=1e-5, rtol=1e-5)


def test_sequences_past_the_context_re_read_it_as_generate_does():
    model = make_model(context=12)
    texts = [list(range(1, 11)), [5], list(range(20, 34)), [7, 8]]  # 10, 1, 14 (over the context) and 2 tokens
    sampling = SamplingConfig(9, 0.8)
    requests = [GenerationRequest(p, sampling, seed=i) for i, p in enumerate(texts)]
    members = run_batch(ContinuousBatch(model, Letters()), requests, [0, 1, 2, 2])
    for i, member in enumerate(members):
        assert member.result == alone(model, texts[i], sampling, i)


def test_the_cache_grows_and_shrinks_with_its_members():
    model = make_model()
    batch = ContinuousBatch(model, Letters(), max_rows=2)
    long = batch.add(GenerationRequest([1] * 10, SamplingConfig(3, 0.0)))
    short = batch.add(GenerationRequest([2], SamplingConfig(30, 0.0)))
    waiting = batch.add(GenerationRequest([3, 4], SamplingConfig(2, 0.0)))
    batch.step()  # both admitted (max_rows 2), the third waits
    assert batch.rows == 2 and list(batch.waiting) == [waiting]
    assert len(batch.cache[0]) == 10 and batch.cache[0].positions.tolist() == [10, 1]
    while not long.done:
        batch.step()
    # the long member left: the slots only it used are gone; the waiting one joined
    assert not short.done and batch.rows == 2
    assert len(batch.cache[0]) == max(len(short.ids), len(waiting.ids)) - 1


def test_concat_rows_right_aligns_and_masks_the_empty_slots():
    a = KVCache(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    b = KVCache(torch.full((2, 2, 1, 4), 2.0), torch.full((2, 2, 1, 4), 2.0))
    joined = KVCache.concat_rows([a, b])
    assert joined.key.shape == (3, 2, 3, 4) and joined.positions.tolist() == [3, 1, 1]
    assert joined.key[1, 0, :2].abs().sum() == 0 and (joined.key[1, 0, 2] == 2).all()
    assert joined.padding_mask()[:, 0, 0].tolist() == [[True] * 3, [False, False, True], [False, False, True]]
    kept = joined.index_select(torch.tensor([0]))
    assert kept.padding_mask() is None and kept.trimmed().key.shape[-2] == 3
    assert joined.index_select(torch.tensor([2, 1])).trimmed().key.shape[-2] == 1
    cut = KVCache(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), start=4)  # a window kept 1 of 5 keys
    with pytest.raises(ValueError, match="window"):
        KVCache.concat_rows([a, cut])
