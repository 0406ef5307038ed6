"""qkv.CausalLM.generate and sample_next: the KV cache changes no token, the left crop past the
context, top-k / top-p on a known distribution, causality, the sampling options' errors, and greedy
decoding against transformers' GPT2LMHeadModel.generate."""

from __future__ import annotations

import math

import pytest
import torch

from qkv import CausalLM, CausalLMConfig
from qkv.models.causal_lm import check_sampling, sample_next

PROBS = [0.5, 0.3, 0.1, 0.05, 0.05]


def tiny_lm(context: int = 16, vocab_size: int = 50, seed: int = 0) -> CausalLM:
    """A random CausalLM with weights large enough that its next-token distributions are far from
    uniform (so argmax is not decided by rounding)."""
    torch.manual_seed(seed)
    model = CausalLM(
        CausalLMConfig(
            vocab_size=vocab_size, d_model=32, num_heads=4, num_layers=2, d_ff=64, context=context, dropout=0.0
        )
    )
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.3)
    return model.eval()


def reference_greedy(model: CausalLM, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decoding spelled out: every step reads the last ``context`` tokens from scratch."""
    out = ids
    with torch.no_grad():
        for _ in range(steps):
            logits = model(out[:, -model.config.context :]).logits[:, -1]
            out = torch.cat([out, logits.argmax(-1, keepdim=True)], dim=1)
    return out


@pytest.mark.parametrize("prompt_len, steps", [(5, 8), (5, 40), (20, 6)])
def test_greedy_with_cache_equals_without(prompt_len, steps):
    """(5, 8) stays inside the context of 16; (5, 40) runs far past it (the left-cropping path);
    (20, 6) starts with a prompt longer than the context."""
    model = tiny_lm(context=16)
    ids = torch.randint(0, 50, (3, prompt_len))
    cached = model.generate(ids, steps, temperature=0)
    uncached = model.generate(ids, steps, temperature=0, use_cache=False)
    assert cached.shape == (3, prompt_len + steps)
    assert torch.equal(cached[:, :prompt_len], ids)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, reference_greedy(model, ids, steps))
    # each row decodes as it would alone
    for row in range(3):
        assert torch.equal(model.generate(ids[row : row + 1], steps, temperature=0), cached[row : row + 1])


@pytest.mark.parametrize("options", [dict(temperature=1.0), dict(temperature=0.7, top_k=10, top_p=0.9)])
def test_sampling_with_a_generator_is_reproducible_with_and_without_cache(options):
    model = tiny_lm(context=16)
    ids = torch.randint(0, 50, (4, 3))
    runs = [
        model.generate(ids, 30, generator=torch.Generator().manual_seed(7), use_cache=use_cache, **options)
        for use_cache in (True, False, True)
    ]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    other = model.generate(ids, 30, generator=torch.Generator().manual_seed(8), **options)
    assert not torch.equal(other, runs[0])  # the generator is what makes it repeat


def draws(n: int = 20000, **options) -> torch.Tensor:
    """``n`` samples from PROBS (as logits), drawn as one batch with a fixed generator."""
    logits = torch.tensor(PROBS).log().expand(n, -1)
    return sample_next(logits, generator=torch.Generator().manual_seed(0), **options)


def frequencies(ids: torch.Tensor) -> torch.Tensor:
    return torch.bincount(ids, minlength=len(PROBS)).double() / ids.numel()


def renormalised(keep: list[int], power: float = 1.0) -> torch.Tensor:
    p = torch.tensor(PROBS, dtype=torch.float64) ** power
    p[[i for i in range(len(PROBS)) if i not in keep]] = 0
    return p / p.sum()


@pytest.mark.parametrize(
    "options, keep",
    [
        (dict(top_p=0.75), [0, 1]),  # 0.5 < 0.75 <= 0.5 + 0.3: the nucleus is {0, 1}
        (dict(top_p=0.85), [0, 1, 2]),
        (dict(top_p=0.4), [0]),
        (dict(top_k=3), [0, 1, 2]),
        (dict(top_k=1), [0]),
        (dict(top_k=3, top_p=0.75), [0, 1]),
        (dict(top_p=1.0), [0, 1, 2, 3, 4]),
        (dict(), [0, 1, 2, 3, 4]),
    ],
)
def test_top_k_and_top_p_on_a_known_distribution(options, keep):
    ids = draws(**options)
    assert set(ids.unique().tolist()) == set(keep)  # never outside; every kept id does occur
    # within about 4 standard deviations of the renormalised probabilities (n = 20000)
    assert torch.allclose(frequencies(ids), renormalised(keep), atol=0.015)


def test_temperature_sharpens_and_zero_is_greedy():
    ids = draws(temperature=0.5)  # softmax(log p / 0.5) is p^2 renormalised
    assert torch.allclose(frequencies(ids), renormalised([0, 1, 2, 3, 4], power=2.0), atol=0.015)
    assert torch.equal(draws(n=10, temperature=0), torch.zeros(10, dtype=torch.long))
    assert torch.equal(draws(n=10, temperature=0, top_k=3, top_p=0.5), torch.zeros(10, dtype=torch.long))


def test_a_tiny_temperature_is_greedy_not_nan():
    # dividing unshifted float32 logits by 1e-40 overflowed to inf and the softmax gave nan
    logits = torch.tensor([[2.0, 1.0, -3.0], [-1.0, 4.0, 3.9]])
    for temperature in (1e-3, 1e-30, 1e-40, 1e-45):
        for options in (dict(), dict(top_k=2), dict(top_p=0.9)):
            assert sample_next(logits, temperature, **options).tolist() == [0, 1]
    model = tiny_lm()  # generate holds temperatures to their range: 1e-40 is refused, not turned into nan
    with pytest.raises(ValueError, match="temperature"):
        model.generate(torch.randint(0, 50, (2, 4)), 5, temperature=1e-40)
    for temperature in (1e-4, 1e-300, float("inf"), float("nan"), 101.0):  # below, above or outside the range
        with pytest.raises(ValueError, match="temperature"):
            model.generate(torch.randint(0, 50, (2, 4)), 5, temperature=temperature)
    for top_p in (1e-300, 0.0, float("nan")):
        with pytest.raises(ValueError, match="top_p"):
            model.generate(torch.randint(0, 50, (2, 4)), 5, temperature=1.0, top_p=top_p)
    model.generate(torch.randint(0, 50, (2, 4)), 5, temperature=1e-3, top_p=1e-6)  # the range's ends are taken


def test_top_k_and_top_p_work_per_row():
    logits = torch.tensor([PROBS, PROBS[::-1]]).log().repeat(5000, 1)  # even rows favour 0, odd rows 4
    gen = torch.Generator().manual_seed(1)
    ids = sample_next(logits, top_k=2, generator=gen)
    assert set(ids[0::2].tolist()) == {0, 1} and set(ids[1::2].tolist()) == {3, 4}
    ids = sample_next(logits, top_p=0.75, generator=gen)
    assert set(ids[0::2].tolist()) == {0, 1} and set(ids[1::2].tolist()) == {3, 4}


def test_output_at_t_does_not_depend_on_later_tokens():
    model = tiny_lm(context=16)
    ids = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        base = model(ids).logits
        for t in (0, 5, 14):
            changed = ids.clone()
            changed[:, t + 1 :] = torch.randint(0, 50, (2, 15 - t))
            assert not torch.equal(changed, ids)
            other = model(changed).logits
            assert (other[:, : t + 1] - base[:, : t + 1]).abs().max() <= 1e-5
            assert (other[:, t + 1 :] - base[:, t + 1 :]).abs().max() > 1e-3  # the later ones do change


@pytest.mark.parametrize(
    "options, name",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=2.0), "max_new_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(top_k=0), "top_k"),
    ],
)
def test_bad_sampling_options_name_the_option(options, name):
    settings = dict(max_new_tokens=5, temperature=1.0, top_k=None, top_p=None) | options
    with pytest.raises(ValueError, match=name):
        check_sampling(**settings)
    model = tiny_lm()
    with pytest.raises(ValueError, match=name) as info:
        model.generate(torch.zeros(1, 2, dtype=torch.long), **settings)
    assert "\n" not in str(info.value)


def test_generate_stops_on_request_and_keeps_the_training_mode():
    model = tiny_lm().train()
    seen = []
    out = model.generate(
        torch.zeros(2, 3, dtype=torch.long),
        10,
        temperature=0,
        on_step=lambda new: seen.append(new.clone()) or len(seen) == 4,
    )
    assert out.shape == (2, 7) and len(seen) == 4
    assert torch.equal(torch.stack(seen, dim=1), out[:, 3:])
    assert model.training  # generate ran in eval mode and put the mode back


def test_greedy_equals_transformers_generate():
    transformers = pytest.importorskip("transformers")
    from qkv.pretrained.gpt2 import build_gpt2, gpt2_config

    config = transformers.GPT2Config(
        vocab_size=300,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
        attn_implementation="eager",
    )
    torch.manual_seed(3)
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # far from uniform, so argmax is not decided by rounding
        for param in hf.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.3)
    ours = build_gpt2(gpt2_config(config.to_dict()), hf.state_dict())
    ids = torch.randint(1, 300, (2, 6))
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert want.shape == (2, 26)
    assert torch.equal(ours.generate(ids, 20, temperature=0), want)
    assert torch.equal(ours.generate(ids, 20, temperature=0, use_cache=False), want)
