"""Structured output in the worker: grammars compiled and cached per spec, refused with the
engine's reason, and enforced by the sampler's bitmask so that every constrained output parses
and validates, whatever the logits, while plain rows in the same batch are untouched."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from workers.contract import DEFAULT_MODEL_DIR
from workers.sampling.grammar import GrammarError, Grammars, GrammarSpec, advance, apply_bitmask, json_text
from workers.sampling.params import SamplingParams
from workers.sampling.sampler import make_generator, sample_tokens

TOKENIZER = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
EOS = 2
VOCAB = 4096
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars.for_tokenizer(TOKENIZER, VOCAB, (EOS,))


class Row:
    def __init__(self, params: SamplingParams, matcher=None):
        self.params = params
        self.generator = make_generator(params.seed or 0) if params.do_sample else None
        self.prompt_ids = [1]
        self.output_ids: list[int] = []
        self.grammar = matcher


def generate(grammars: Grammars, spec: GrammarSpec, seed: int, steps: int = 200) -> str:
    """Draw from random logits under the grammar until it is complete; the text produced."""
    row = Row(SamplingParams.create(temperature=1.5, seed=seed, grammar=spec), grammars.compile(spec).matcher())
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        token = sample_tokens(torch.randn(1, VOCAB, generator=gen) * 3, [row], grammars).token_ids[0]
        row.output_ids.append(token)
        if token == EOS or advance(row.grammar, token):
            break
    return TOKENIZER.decode([t for t in row.output_ids if t != EOS])


@pytest.mark.parametrize("seed", range(4))
def test_random_logits_under_a_schema_always_give_valid_json(grammars, seed):
    """Guards the bitmask in `sample_tokens` (without it, random logits never make JSON)."""
    text = generate(grammars, GrammarSpec("json_schema", json_text(PERSON)), seed)
    jsonschema.validate(json.loads(text), PERSON)
    assert list(json.loads(text)) == ["name", "age", "tags"]  # properties come in the schema's order


def test_json_object_and_regex_grammars(grammars):
    obj = generate(grammars, GrammarSpec("json_object"), seed=7, steps=400)
    assert isinstance(json.loads(obj), dict)
    for seed in range(3):
        text = generate(grammars, GrammarSpec("regex", r"(yes|no), [a-z]{2,8}\."), seed)
        assert text.startswith(("yes, ", "no, ")) and text.endswith(".") and text[-2].isalpha()


def test_a_constrained_row_leaves_its_batch_mates_alone(grammars):
    spec = GrammarSpec("json_schema", json_text(PERSON))
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    plain = sample_tokens(logits, [Row(SamplingParams()), Row(SamplingParams())], grammars)
    mixed = sample_tokens(logits, [Row(SamplingParams()),
                                   Row(SamplingParams(grammar=spec), grammars.compile(spec).matcher()),
                                   Row(SamplingParams())], grammars)
    assert [mixed.token_ids[0], mixed.token_ids[2]] == [plain.token_ids[0], logits[2].argmax().item()]
    assert mixed.logprobs[0] == pytest.approx(plain.logprobs[0])
    assert TOKENIZER.decode([mixed.token_ids[1]]).startswith("{")
    # the constrained row's logprob is renormalized over what the grammar allows
    assert mixed.logprobs[1] > torch.log_softmax(logits[1], -1)[mixed.token_ids[1]].item()


def test_compiled_grammars_are_cached_per_spec(grammars):
    spec = GrammarSpec("json_schema", json_text({"type": "object", "properties": {"x": {"type": "integer"}}}))
    before = grammars.compiled
    first = grammars.compile(spec)
    assert grammars.compile(GrammarSpec("json_schema", spec.text)) is first
    assert grammars.compiled == before + 1
    a, b = first.matcher(), first.matcher()
    assert advance(a, TOKENIZER.token_to_id("{")) is False
    assert b.is_accepting() is False and not b.is_error()  # copies do not share state


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (GrammarSpec("json_schema", json_text({"type": "string", "format": "zipcode"})), "Unknown format: zipcode"),
        (GrammarSpec("json_schema", json_text({"type": "wat"})), "Invalid type: wat"),
        (GrammarSpec("json_schema", json_text({"$ref": "#/$defs/missing"})), "does not exist"),
        (GrammarSpec("regex", "(unclosed"), "unclosed group"),
    ],
)
def test_what_the_engine_cannot_enforce_is_refused_with_its_reason(grammars, spec, needle):
    with pytest.raises(GrammarError) as e:
        grammars.compile(spec)
    assert needle in str(e.value) and "cannot be enforced" in str(e.value)


def test_a_non_strict_schema_ignores_unknown_keywords(grammars):
    schema = json_text({"type": "object", "properties": {"zip": {"type": "string", "format": "zipcode"}}})
    grammars.compile(GrammarSpec("json_schema", schema, strict=False))
    with pytest.raises(GrammarError):
        grammars.compile(GrammarSpec("json_schema", schema, strict=True))


def test_malformed_specs_are_refused():
    with pytest.raises(GrammarError, match="not valid JSON"):
        json_text("{nope")
    with pytest.raises(GrammarError, match="must be a JSON schema"):
        json_text([1, 2])
    with pytest.raises(GrammarError, match="Supported: json_schema, json_object, regex"):
        GrammarSpec("lark", "start: x")


def test_a_row_whose_mask_allows_nothing_may_only_end():
    """Guards the EOS fallback in `apply_bitmask`: an all-zero mask would give NaN logprobs."""
    logits = torch.zeros(2, 64)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[1] = -1
    apply_bitmask(logits, bitmask, [0, 1], fallback_ids=(EOS,))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]
    assert torch.isfinite(logits[1]).all()


def test_grammar_matchers_stay_consistent_over_many_random_schemas(grammars):
    """Several schemas at once in one batch: each row's output validates against its own."""
    schemas = [PERSON, {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 4},
               {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}]
    rows = []
    for i, schema in enumerate(schemas):
        spec = GrammarSpec("json_schema", json_text(schema))
        rows.append(Row(SamplingParams.create(temperature=1.2, seed=i, grammar=spec), grammars.compile(spec).matcher()))
    gen, done = torch.Generator().manual_seed(random.Random(5).randrange(1000)), [False] * len(rows)
    for _ in range(200):
        live = [r for r, d in zip(rows, done, strict=True) if not d]
        if not live:
            break
        out = sample_tokens(torch.randn(len(live), VOCAB, generator=gen) * 3, live, grammars)
        for r, token in zip(live, out.token_ids, strict=True):
            r.output_ids.append(token)
            if token == EOS or advance(r.grammar, token):
                done[rows.index(r)] = True
    for r, schema in zip(rows, schemas, strict=True):
        jsonschema.validate(json.loads(TOKENIZER.decode([t for t in r.output_ids if t != EOS])), schema)
