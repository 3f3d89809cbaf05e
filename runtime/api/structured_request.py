"""The request's output constraint: ``response_format`` (OpenAI) or ``structured_outputs``
(vLLM) -> one ``GrammarSpec`` for the sampler.

Only the shape and size are checked here (one constraint, a schema present, choices
non-empty, the bounds of ``runtime/structured/spec.py`` before anything is copied); whether
the schema, regex or grammar parses is decided by the engine core with xgrammar, off its
loop, which answers an invalid one with a 400 naming the field.
"""

from __future__ import annotations

import json

from shoal.runtime.structured.spec import (
    MAX_CHOICES,
    GrammarSpec,
    grammar_bounds_error,
    json_schema_spec,
)

from .errors import bad_request
from .protocol import ResponseFormat, SamplingFields, StructuredOutputs


def grammar_for(body: SamplingFields) -> GrammarSpec | None:
    fmt = body.response_format
    constrained = fmt is not None and fmt.type != "text"
    if constrained and body.structured_outputs is not None:
        raise bad_request("give response_format or structured_outputs, not both",
                          "structured_outputs")
    spec = None
    if fmt is not None and constrained:
        spec = _from_response_format(fmt)
    elif body.structured_outputs is not None:
        spec = _from_structured_outputs(body.structured_outputs)
    if spec is not None and (error := grammar_bounds_error(spec)) is not None:
        raise bad_request(error, spec.param)
    return spec


def _from_response_format(fmt: ResponseFormat) -> GrammarSpec:
    if fmt.type == "json_object":
        return GrammarSpec(kind="json_object", param="response_format")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema",
                          "response_format.json_schema")
    return json_schema_spec(fmt.json_schema.schema_, "response_format.json_schema")


def _from_structured_outputs(so: StructuredOutputs) -> GrammarSpec:
    given = [name for name, value in (("json", so.json_), ("regex", so.regex),
                                      ("choice", so.choice), ("grammar", so.grammar),
                                      ("json_object", so.json_object or None))
             if value is not None]
    if len(given) != 1:
        raise bad_request("structured_outputs takes exactly one of json, json_object, regex, "
                          f"choice, grammar (got {', '.join(given) or 'none'})",
                          "structured_outputs")
    param = f"structured_outputs.{given[0]}"
    if so.json_ is not None:
        schema = so.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise bad_request(f"structured_outputs.json is not valid JSON: {exc}",
                                  param) from exc
        if not isinstance(schema, dict):
            raise bad_request("structured_outputs.json must be a JSON schema object", param)
        return json_schema_spec(schema, param)
    if so.regex is not None:
        return GrammarSpec(kind="regex", source=so.regex, param=param)
    if so.choice is not None:
        if not so.choice:
            raise bad_request("structured_outputs.choice must not be empty", param)
        if len(so.choice) > MAX_CHOICES:  # before copying a list of any length
            raise bad_request(f"{param} has {len(so.choice)} entries; at most {MAX_CHOICES} "
                              "are allowed", param)
        return GrammarSpec(kind="choice", source=json.dumps(so.choice), param=param)
    if so.grammar is not None:
        return GrammarSpec(kind="grammar", source=so.grammar, param=param)
    return GrammarSpec(kind="json_object", param=param)
