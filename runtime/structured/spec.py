"""What a request's output must match: a JSON schema, any JSON object, a regex, one of some
strings, or an EBNF grammar. A msgspec struct because it crosses the API -> engine-core
boundary inside ``SamplingParams``.

``check_grammar`` parses the spec with xgrammar (no tokenizer needed), so an invalid schema
is an ``InvalidParameter`` before any engine state changes; the engine core calls it (the
API process does not import xgrammar: it pulls in torch). The worker compiles the same spec
against the vocabulary (``runtime/structured/backend.py``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar"]


class GrammarSpec(msgspec.Struct, frozen=True, kw_only=True):
    kind: GrammarKind
    source: str = ""  # schema JSON text, regex, EBNF, or a JSON list of choices
    param: str = "structured_outputs"  # the request field it came from (for errors)


class GrammarError(ValueError):
    """The spec does not parse as the grammar it claims to be."""


def json_schema_spec(schema: dict[str, Any], param: str) -> GrammarSpec:
    return GrammarSpec(kind="json", source=json.dumps(schema, sort_keys=True), param=param)


def choice_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"``: JSON string escapes are valid EBNF string-literal escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def to_xgrammar(spec: GrammarSpec):  # -> xgrammar.Grammar
    """The spec as an xgrammar Grammar; raises GrammarError naming what is wrong."""
    import xgrammar as xgr

    try:
        if spec.kind == "json":
            return xgr.Grammar.from_json_schema(spec.source, any_whitespace=False,
                                                strict_mode=True)
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                                strict_mode=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.source)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec.source)))
        return xgr.Grammar.from_ebnf(spec.source)
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar raises RuntimeError
        raise GrammarError(f"invalid {spec.kind} for {spec.param}: {_first_line(exc)}") from exc


def check_grammar(spec: GrammarSpec) -> None:
    to_xgrammar(spec)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    # xgrammar prefixes "[hh:mm:ss] /path/file.cc:123: "; keep what it says
    line = text[-1] if text else type(exc).__name__
    return line.split(": ", 1)[-1] if line.startswith("[") else line
