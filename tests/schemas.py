"""JSON schemas the structured-output tests of the engine and of the pipeline share:
bounded numbers and a length-bounded string, nested objects in a bounded array with
an enum and a boolean, and an array of enums."""

from __future__ import annotations

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
    },
    "required": ["name", "age", "score"],
}
ORDER = {
    "type": "object",
    "properties": {
        "status": {"enum": ["open", "shipped", "lost"]},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 6},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "qty"],
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "express": {"type": "boolean"},
    },
    "required": ["status", "items", "express"],
}
LABELS = {"type": "object", "properties": {"labels": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                      "maxItems": 4}},
          "required": ["labels"]}
