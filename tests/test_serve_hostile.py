"""Hostile request bodies against every JSON endpoint of ``qkv serve``: each field of a valid body
replaced by values of the wrong type, out of range, non-finite, huge, empty or not Unicode, and bodies
that are not objects, lack a field, add one, nest deep or are not JSON at all. Every answer is either
the valid one (200, where the value happens to be allowed) or a 4xx with one line of JSON naming the
problem; never a 5xx, and the server answers a valid request afterwards. The counts are printed
(``-s``) and quoted in docs/reliability.md."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from test_serve import assert_json_error
from test_serve_api import SENTENCES, make_client, models  # noqa: F401  (the module's fixture)

pytest.importorskip("fastapi")

JSON = {"Content-Type": "application/json"}

# a valid body of each endpoint (small, so that the values that are allowed answer quickly)
VALID = {
    "/v1/translate": {"texts": SENTENCES[:2], "beam_size": 2, "alpha": 0.6, "penalty": "gnmt", "model": "en-de"},
    "/v1/generate": {
        "prompt": "First",
        "max_tokens": 4,
        "temperature": 0.8,
        "top_k": 5,
        "top_p": 0.9,
        "seed": 1,
        "stop": ["\n"],
        "stream": False,
        "model": "lm",
    },
    "/v1/embed": {"texts": ["the dog runs"], "normalize": True, "model": "tiny-bert"},
    "/api/attend": {"text": "the dog runs", "model": "tiny-bert"},
}

# raw JSON texts put in place of one field's value: wrong types, out of range, non-finite (Python's
# json reads NaN, Infinity and 1e999), huge, empty, lone surrogates, nesting
HOSTILE_VALUES = [
    "null",
    "true",
    "-1",
    "0",
    "1e999",
    "-1e999",
    "NaN",
    "Infinity",
    "1" + "0" * 100,
    "1e-300",
    '""',
    '"   "',
    '"\\ud800"',
    '"' + "x" * 5000 + '"',
    "[]",
    "[[[[[[[[[[]]]]]]]]]]",
    '{"a": 1}',
    '["\\u0000"]',
]

# whole bodies that are not what any endpoint takes
HOSTILE_BODIES = [
    b"",
    b"null",
    b"[]",
    b'"text"',
    b"42",
    b"{",
    b'{"text": "the dog"',
    b"\xff\xfe\x00not utf-8",
    b"[" * 5000 + b"]" * 5000,
    b'{"a":' * 3000 + b"1" + b"}" * 3000,
    b'{"texts": ' + b"9" * 5000 + b"}",
]


def hostile_requests() -> list[tuple[str, bytes]]:
    """(path, body) for every hostile body: each field of each valid body replaced by each hostile
    value, each field dropped, an unknown field added, and the whole bodies above."""
    cases = []
    for path, valid in VALID.items():
        for field in valid:
            for raw in HOSTILE_VALUES:
                rest = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in valid.items() if k != field)
                cases.append((path, f"{{{rest}{', ' if rest else ''}{json.dumps(field)}: {raw}}}".encode()))
            cases.append((path, json.dumps({k: v for k, v in valid.items() if k != field}).encode()))
        cases.append((path, json.dumps({**valid, "unknown_field": 1}).encode()))
        cases += [(path, body) for body in HOSTILE_BODIES]
    return cases


def test_every_hostile_body_is_a_4xx_in_one_line_or_a_valid_answer(models):  # noqa: F811
    outcomes: Counter[str] = Counter()
    with make_client(models, max_texts=8, max_new_tokens=64, max_body_bytes=20_000) as client:
        for path, body in hostile_requests():
            response = client.post(path, content=body, headers=JSON)
            assert response.status_code < 500, (path, body[:120], response.status_code, response.text[:200])
            if response.status_code == 200:
                outcomes["200 (the value is allowed)"] += 1
                continue
            assert 400 <= response.status_code < 500, (path, body[:120], response.status_code)
            assert_json_error(response.headers, response.content)
            outcomes[str(response.status_code)] += 1
        # the server still answers a valid request of each kind
        for path, valid in VALID.items():
            response = client.post(path, content=json.dumps(valid).encode(), headers=JSON)
            assert response.status_code == 200, (path, response.text[:200])
    total = sum(outcomes.values())
    print(f"\n{total} hostile bodies: " + ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())))
    assert total == len(hostile_requests())
    assert sum(v for k, v in outcomes.items() if k.startswith("4")) > 0.8 * total  # most are refused, not allowed
