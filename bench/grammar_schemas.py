"""JSON schemas for the grammar benchmarks: the 20-field nested schema with a generator of valid
instances, and the feature cases (a schema, instances it must accept, instances it must refuse) for
each JSON Schema keyword.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass

COUNTRIES = ["FR", "DE", "US", "JP", "BR"]
STATUSES = ["new", "active", "suspended", "closed"]
CONTACT_KINDS = ["email", "phone", "fax"]

# 20 fields: 11 at the top, 5 in `address`, 2 in each contact, 2 in `preferences`.
NESTED_20_FIELDS = {
    "type": "object",
    "$defs": {
        "contact": {
            "type": "object",
            "properties": {
                "kind": {"enum": CONTACT_KINDS},
                "value": {"type": "string", "minLength": 3, "maxLength": 40},
            },
            "required": ["kind", "value"],
            "additionalProperties": False,
        },
    },
    "properties": {
        "customer_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{6}$"},
        "name": {"type": "string", "minLength": 1, "maxLength": 60},
        "age": {"type": "integer", "minimum": 18, "maximum": 120},
        "balance": {"type": "number", "minimum": 0},
        "vip": {"type": "boolean"},
        "status": {"enum": STATUSES},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 80},
                "city": {"type": "string", "maxLength": 40},
                "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": COUNTRIES},
                "floor": {
                    "anyOf": [{"type": "integer", "minimum": 0, "maximum": 200}, {"type": "null"}]
                },
            },
            "required": ["street", "city", "postal_code", "country", "floor"],
            "additionalProperties": False,
        },
        "contacts": {
            "type": "array",
            "items": {"$ref": "#/$defs/contact"},
            "minItems": 1,
            "maxItems": 3,
        },
        "preferences": {
            "type": "object",
            "properties": {
                "newsletter": {"type": "boolean"},
                "language": {"type": "string", "enum": ["en", "fr", "de", "ja"]},
            },
            "required": ["newsletter", "language"],
            "additionalProperties": False,
        },
        "notes": {"type": "string", "maxLength": 200},
    },
    "required": [
        "customer_id",
        "name",
        "age",
        "balance",
        "vip",
        "status",
        "tags",
        "address",
        "contacts",
        "preferences",
        "notes",
    ],
    "additionalProperties": False,
}

_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike november "
    "oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


def _words(rng: random.Random, lo: int, hi: int, limit: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))[:limit].strip() or "x"


def nested_instance(rng: random.Random) -> dict:
    """A random instance of NESTED_20_FIELDS, keys in the schema's order (as models write it)."""
    digits = string.digits
    return {
        "customer_id": "".join(rng.choice(string.ascii_uppercase) for _ in range(2))
        + "-"
        + "".join(rng.choice(digits) for _ in range(6)),
        "name": _words(rng, 1, 3, 60).title(),
        "age": rng.randint(18, 120),
        "balance": round(rng.uniform(0, 100000), 2),
        "vip": rng.random() < 0.5,
        "status": rng.choice(STATUSES),
        "tags": [rng.choice(_WORDS) for _ in range(rng.randint(0, 5))],
        "address": {
            "street": f"{rng.randint(1, 999)} {_words(rng, 1, 3, 70).title()} Street",
            "city": _words(rng, 1, 2, 40).title(),
            "postal_code": "".join(rng.choice(digits) for _ in range(5)),
            "country": rng.choice(COUNTRIES),
            "floor": rng.choice([None, rng.randint(0, 200)]),
        },
        "contacts": [
            {
                "kind": rng.choice(CONTACT_KINDS),
                "value": f"{rng.choice(_WORDS)}.{rng.randint(1, 99)}@example.com",
            }
            for _ in range(rng.randint(1, 3))
        ],
        "preferences": {
            "newsletter": rng.random() < 0.5,
            "language": rng.choice(["en", "fr", "de", "ja"]),
        },
        "notes": _words(rng, 0, 20, 200),
    }


@dataclass
class FeatureCase:
    """One JSON Schema feature: a schema, texts it must accept and texts it must refuse."""

    feature: str
    schema: dict
    valid: list[str]
    invalid: list[str]


def _obj(props: dict, required: list[str] | None = None, **extra) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        **extra,
    }


FEATURE_CASES: list[FeatureCase] = [
    FeatureCase(
        "nested objects",
        _obj({"a": _obj({"b": _obj({"c": {"type": "integer"}})})}),
        ['{"a": {"b": {"c": 1}}}'],
        ['{"a": {"b": {}}}', '{"a": {"b": {"c": "x"}}}'],
    ),
    FeatureCase(
        "arrays (items, minItems, maxItems)",
        {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
        ["[1]", "[1, 2, 3]"],
        ["[]", "[1, 2, 3, 4]", '["a"]'],
    ),
    FeatureCase(
        "enum",
        _obj({"s": {"enum": ["red", "green", 3]}}),
        ['{"s": "red"}', '{"s": 3}'],
        ['{"s": "blue"}', '{"s": 4}'],
    ),
    FeatureCase(
        "required",
        _obj({"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a"]),
        ['{"a": 1}', '{"a": 1, "b": 2}'],
        ['{"b": 2}', "{}"],
    ),
    FeatureCase(
        "$ref to $defs",
        {"$defs": {"p": _obj({"x": {"type": "integer"}})}, **_obj({"p": {"$ref": "#/$defs/p"}})},
        ['{"p": {"x": 1}}'],
        ['{"p": {"x": "1"}}', '{"p": {}}'],
    ),
    FeatureCase(
        "recursive $ref",
        {
            "$defs": {
                "node": _obj(
                    {
                        "v": {"type": "integer"},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    }
                )
            },
            "$ref": "#/$defs/node",
        },
        ['{"v": 1, "kids": [{"v": 2, "kids": []}]}'],
        ['{"v": 1, "kids": [{"v": "2", "kids": []}]}'],
    ),
    FeatureCase(
        "anyOf",
        _obj({"x": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}}),
        ['{"x": 5}', '{"x": "ab"}'],
        ['{"x": true}', '{"x": "abc"}'],
    ),
    FeatureCase(
        "oneOf (disjoint)",
        _obj({"x": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}}),
        ['{"x": 5}', '{"x": false}'],
        ['{"x": "5"}'],
    ),
    FeatureCase(
        "allOf",
        {"allOf": [_obj({"a": {"type": "integer"}}), _obj({"b": {"type": "string"}})]},
        ['{"a": 1, "b": "x"}'],
        ['{"a": 1}', '{"b": "x"}'],
    ),
    FeatureCase(
        "type list with null",
        _obj({"x": {"type": ["string", "null"]}}),
        ['{"x": null}', '{"x": "s"}'],
        ['{"x": 1}'],
    ),
    FeatureCase("const", _obj({"v": {"const": "v1"}}), ['{"v": "v1"}'], ['{"v": "v2"}']),
    FeatureCase(
        "pattern",
        _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
        ['{"code": "ABC-12"}'],
        ['{"code": "abc-12"}', '{"code": "ABC-123"}'],
    ),
    FeatureCase(
        "minLength / maxLength",
        _obj({"s": {"type": "string", "minLength": 2, "maxLength": 4}}),
        ['{"s": "ab"}', '{"s": "abcd"}'],
        ['{"s": "a"}', '{"s": "abcde"}'],
    ),
    FeatureCase(
        "integer minimum / maximum",
        _obj({"n": {"type": "integer", "minimum": 10, "maximum": 99}}),
        ['{"n": 10}', '{"n": 99}'],
        ['{"n": 9}', '{"n": 100}', '{"n": -50}'],
    ),
    FeatureCase(
        "number exclusiveMinimum / maximum",
        _obj({"x": {"type": "number", "exclusiveMinimum": 0, "maximum": 1.5}}),
        ['{"x": 0.5}', '{"x": 1.5}'],
        ['{"x": 0}', '{"x": -1.0}', '{"x": 2}'],
    ),
    FeatureCase(
        "additionalProperties: false",
        _obj({"a": {"type": "integer"}}, additionalProperties=False),
        ['{"a": 1}'],
        ['{"a": 1, "b": 2}'],
    ),
    FeatureCase(
        "additionalProperties: schema",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        ['{"x": 1, "y": 2}', "{}"],
        ['{"x": "1"}'],
    ),
    FeatureCase(
        "additionalProperties unset (extra keys allowed)",
        _obj({"a": {"type": "integer"}}),
        ['{"a": 1}', '{"a": 1, "b": "extra"}'],
        ['{"a": "1"}'],
    ),
    FeatureCase(
        "format: date-time",
        _obj({"t": {"type": "string", "format": "date-time"}}),
        ['{"t": "2026-11-23T18:00:00Z"}'],
        ['{"t": "yesterday"}'],
    ),
    FeatureCase(
        "format: email",
        _obj({"e": {"type": "string", "format": "email"}}),
        ['{"e": "a.b@example.com"}'],
        ['{"e": "not an email"}'],
    ),
    FeatureCase(
        "format: uuid",
        _obj({"u": {"type": "string", "format": "uuid"}}),
        ['{"u": "123e4567-e89b-12d3-a456-426614174000"}'],
        ['{"u": "123"}'],
    ),
    FeatureCase(
        "prefixItems (tuples)",
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
        ['[1, "a"]'],
        ['["a", 1]', '[1, "a", 2]'],
    ),
    FeatureCase(
        "minProperties / maxProperties",
        {
            "type": "object",
            "additionalProperties": {"type": "integer"},
            "minProperties": 1,
            "maxProperties": 2,
        },
        ['{"a": 1}', '{"a": 1, "b": 2}'],
        ["{}", '{"a": 1, "b": 2, "c": 3}'],
    ),
    FeatureCase(
        "multipleOf", _obj({"n": {"type": "integer", "multipleOf": 5}}), ['{"n": 15}'], ['{"n": 7}']
    ),
    FeatureCase(
        "uniqueItems",
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        ["[1, 2]"],
        ["[1, 1]"],
    ),
    FeatureCase(
        "the 20-field nested schema",
        NESTED_20_FIELDS,
        [json.dumps(nested_instance(random.Random(seed))) for seed in range(3)],
        ['{"customer_id": "x"}'],
    ),
]


def pydantic_case() -> FeatureCase:
    """The schema openai's client sends for `chat.completions.parse(response_format=Model)`:
    pydantic's own schema made strict by the client (every property required, additionalProperties
    false, $defs for nested models)."""
    import enum

    from openai.lib._pydantic import to_strict_json_schema
    from pydantic import BaseModel

    class Color(str, enum.Enum):
        red = "red"
        blue = "blue"

    class Item(BaseModel):
        name: str
        quantity: int
        color: Color

    class Order(BaseModel):
        order_id: str
        items: list[Item]
        note: str | None

    schema = to_strict_json_schema(Order)
    valid = (
        '{"order_id": "A1", "items": [{"name": "pen", "quantity": 2, "color": "red"}], '
        '"note": null}'
    )
    invalid = [
        '{"order_id": "A1", "items": [{"name": "pen", "quantity": 2, "color": "green"}], '
        '"note": null}',
        '{"order_id": "A1", "items": []}',
    ]
    return FeatureCase("openai client: pydantic model (strict)", schema, [valid], invalid)
