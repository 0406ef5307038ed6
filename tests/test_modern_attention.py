"""The attention of today's models inside qkv's own language model: every combination of rotary or
ALiBi positions, grouped-query heads, a sliding window, QK-norm, RMSNorm and the gated feed-forward
gives the same logits step by step with its KV cache as over the whole text at once; the cache holds
only the key/value heads and, with a window, only the window; no NaN where a row sees nothing; and the
per-head weights the explorer shows are an independent softmax of the same scores.
(The exactness against transformers' Llama, Mistral and Qwen2 is tests/test_pretrained_llama.py.)"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from qkv.attention.multihead import MultiHeadAttention
from qkv.models.causal_lm import CausalLM, CausalLMConfig

COMBINATIONS = [
    dict(positional=p, num_kv_heads=kv, sliding_window=w, qk_norm=qn, norm=n, activation=a)
    for (p, kv, w, qn), (n, a) in zip(
        itertools.product(("rotary", "alibi", "learned"), (None, 2, 1), (None, 5), (False, True)),
        itertools.cycle([("rms", "swiglu"), ("layer", "gelu_tanh"), ("rms", "relu2"), ("layer", "geglu")]),
    )
]


def _lm(seed: int = 0, **options) -> CausalLM:
    torch.manual_seed(seed)
    config = dict(vocab_size=61, d_model=32, num_heads=4, num_layers=2, d_ff=48, context=64, dropout=0.0)
    return CausalLM(CausalLMConfig(**(config | options))).eval()


@pytest.mark.parametrize("options", COMBINATIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_cached_steps_equal_the_whole_text(options):
    model = _lm(1, **options)
    ids = torch.randint(0, 61, (3, 23), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :6])  # a prompt, then one token at a time
        cache, steps = out.cache, [out.logits]
        for t in range(6, ids.size(1)):
            out = model(ids[:, t : t + 1], cache=cache)
            cache, steps = out.cache, [*steps, out.logits]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-5, rtol=1e-5)
    kv_heads = options["num_kv_heads"] or 4
    assert cache[0].key.shape[1] == kv_heads  # the cache holds the key/value heads only
    window = options["sliding_window"]
    assert len(cache[0]) == (ids.size(1) if window is None else window - 1)
    assert cache[0].end == ids.size(1)


def test_a_grouped_query_cache_is_smaller_by_the_group():
    full, grouped = _lm(num_heads=4), _lm(num_heads=4, num_kv_heads=1)
    ids = torch.randint(0, 61, (2, 30))
    with torch.no_grad():
        a, b = full(ids).cache, grouped(ids).cache
    bytes_ = lambda cache: sum(c.key.nbytes + c.value.nbytes for c in cache)  # noqa: E731
    assert bytes_(a) == 4 * bytes_(b)


def test_greedy_generation_with_and_without_the_cache_is_the_same():
    model = _lm(3, positional="rotary", num_kv_heads=2, sliding_window=6, norm="rms", activation="swiglu")
    prompt = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(4))
    cached = model.generate(prompt, 40, temperature=0, use_cache=True)
    plain = model.generate(prompt, 40, temperature=0, use_cache=False)
    assert torch.equal(cached, plain)


def _scores_by_hand(attention: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """Each head's causal, windowed, ALiBi-biased weights, written out here in float64 from the module's
    weights (rotary and QK-norm left out: this attention has none)."""
    b, s, e = x.shape
    h, h_kv, d = attention.num_heads, attention.num_kv_heads, attention.head_dim
    x = x.double()
    q = (x @ attention.q_proj.weight.double().T).view(b, s, h, d).transpose(1, 2)
    k = (x @ attention.k_proj.weight.double().T).view(b, s, h_kv, d).transpose(1, 2)
    k = k.repeat_interleave(h // h_kv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)  # (b, h, s, s)
    slopes = [2 ** (-8 * (j + 1) / h) for j in range(h)]
    for head, i, j in itertools.product(range(h), range(s), range(s)):
        seen = j <= i and (attention.window is None or i - j < attention.window)
        scores[:, head, i, j] = scores[:, head, i, j] - slopes[head] * (i - j) if seen else float("-inf")
    return torch.softmax(scores, dim=-1)


def test_the_weights_shown_are_the_attention_computed_by_hand():
    attention = MultiHeadAttention(32, 4, num_kv_heads=2, window=3, alibi=True, bias=False).eval()
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        out = attention(x, is_causal=True, need_weights=True)
    torch.testing.assert_close(out.weights.double(), _scores_by_hand(attention, x), atol=1e-5, rtol=1e-5)


def test_a_row_that_sees_nothing_gives_zeros_not_nan():
    attention = MultiHeadAttention(32, 4, num_kv_heads=2, window=2, alibi=True).eval()
    x = torch.randn(2, 6, 32, requires_grad=True)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 3:] = False  # padding: row 0's queries 3 and 4 see no key (the window covers only padding)
    mask[0, :3] = True
    out = attention(x, key_padding_mask=mask, is_causal=True, need_weights=True)
    assert not out.output.isnan().any() and not out.weights.isnan().any()
    assert out.weights[0, :, 4:].abs().sum() == 0  # queries 4, 5 of row 0: both window keys are padding
    out.output.sum().backward()
    assert not x.grad.isnan().any()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_kv_heads", 3),
        ("sliding_window", 0),
        ("sliding_window_layers", [5]),
        ("norm", "batch"),
        ("rotary_scaling", "yarn"),
        ("rotary_fraction", 0.0),
        ("logit_softcap", -1.0),
        ("positional", "relative"),
    ],
)
def test_a_bad_option_is_refused_in_one_line_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field if field != "positional" else "positional") as info:
        _lm(**{field: value, **({"positional": "rotary"} if field.startswith("rotary") else {})})
    assert "\n" not in str(info.value)


def test_the_window_applies_to_the_listed_layers_only():
    model = _lm(positional="rotary", sliding_window=4, sliding_window_layers=[1])
    assert [layer.self_attn.window for layer in model.decoder.layers] == [None, 4]


def test_logit_softcap_bounds_the_logits_and_the_loss_reads_them():
    model = _lm(logit_softcap=2.0)
    ids = torch.randint(0, 61, (2, 9))
    logits = model(ids).logits
    assert logits.abs().max() <= 2.0
    targets = ids.roll(-1, 1)
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 61), targets.reshape(-1), reduction="sum")
    torch.testing.assert_close(model.loss(ids, targets), want)


def test_every_part_trains_under_bf16_autocast():
    """A step in bf16 autocast (the LM recipe's precision where bf16 is fast): the norms' float32
    weights must not leave the queries and keys in another dtype than the values."""
    model = _lm(positional="rotary", norm="rms", activation="swiglu", num_kv_heads=2, sliding_window=5, qk_norm=True)
    model.train()
    ids = torch.randint(0, 61, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(ids, ids.roll(-1, 1))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)
