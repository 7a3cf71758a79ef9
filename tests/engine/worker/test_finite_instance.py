"""has_finite_instance: a recursive schema with a finite instance passes (jsonschema validates
that instance: the oracle), one whose every instance must contain another does not."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.worker.finite_instance import has_finite_instance

TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["kids"],
        }
    },
    "$ref": "#/$defs/node",
}
# Schemas with a finite instance, and one.
FINITE = {
    "tree": (TREE, {"kids": [{"kids": []}]}),
    "optional self": ({"type": "object", "properties": {"a": {"$ref": "#"}}}, {}),
    "untyped required self": ({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}, 1),
    "self or null": (
        {"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
         "required": ["a"]},
        {"a": None},
    ),
    "object or null": ({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}},
                        "required": ["a"]}, None),
    "array of self": ({"type": "array", "items": {"$ref": "#"}}, []),
    "plain": ({"enum": ["a"]}, "a"),
    "true": (True, 0),
}  # fmt: skip
# Schemas whose every instance contains another instance: none is finite.
INFINITE = {
    "only its own ref": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "a cycle of refs": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}},
        "$ref": "#/$defs/a",
    },
    "required self": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    "self or nothing": {
        "type": "object",
        "properties": {"a": {"anyOf": [{"$ref": "#"}, False]}},
        "required": ["a"],
    },
    "first item self": {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    "prefix item self": {"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1},
    "escaped pointer": {"$defs": {"a/b": {"allOf": [{"$ref": "#/$defs/a~1b"}]}},
                        "$ref": "#/$defs/a~1b"},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(FINITE))
def test_a_schema_with_a_finite_instance_passes(name):
    schema, instance = FINITE[name]
    jsonschema.validate(instance, schema)
    assert has_finite_instance(json.dumps(schema))


@pytest.mark.parametrize("name", sorted(INFINITE))
def test_a_schema_whose_instances_all_contain_another_fails(name):
    assert not has_finite_instance(json.dumps(INFINITE[name]))


def test_what_it_cannot_read_or_has_no_ref_is_left_to_llguidance():
    assert has_finite_instance("{not json")
    assert has_finite_instance("false")  # no instance at all: llguidance says so
    assert has_finite_instance(json.dumps({"$ref": "#/nowhere"}))
    assert has_finite_instance(json.dumps({"$ref": "https://example.com/schema"}))
    deep = '{"allOf": [' * 5000 + '{"$ref": "#"}' + "]}" * 5000
    assert has_finite_instance(deep)
