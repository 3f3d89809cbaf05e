"""What a request's output must match: a JSON schema, any JSON object, a regex, one of some
strings, or an EBNF grammar. A msgspec struct because it crosses the API -> engine-core
boundary inside ``SamplingParams``.

``grammar_bounds_error`` bounds a spec's size before any work (both processes, through
``SamplingParams.validate``): compile time grows faster than linearly with the number of
alternatives (a 250k-string choice list compiled for over 30 s), so sizes that no real schema
needs are a 400 naming the field. Whether a spec parses is decided when it is compiled, off
the engine loop (``runtime/structured/compiler.py``; the API process does not import
xgrammar: it pulls in torch); ``check_grammar`` parses without a tokenizer, for tests and tools.
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
    # reasoning models: the constraint starts after the output has written these tokens
    # (the reasoning span's end, ``</think>``); empty: from the first token
    start_after: tuple[int, ...] = ()


def grammar_start(spec: GrammarSpec, output_token_ids: list[int]) -> int | None:
    """Where in the output the constrained part begins: 0 without ``start_after``, else just
    after its first occurrence; None while the output has not written it yet."""
    marker = list(spec.start_after)
    if not marker:
        return 0
    for end in range(len(marker), len(output_token_ids) + 1):
        if output_token_ids[end - len(marker):end] == marker:
            return end
    return None


class GrammarError(ValueError):
    """The spec does not parse as the grammar it claims to be."""


# Bounds on a spec's source, checked before anything parses it. Measured on a 151k-token
# vocabulary (2 loaded cores): 5,000 choices compile in ~2 s; a JSON schema of a few KiB in
# milliseconds. The compile budget (``--grammar-compile-timeout``) catches what stays slow.
MAX_GRAMMAR_BYTES = 256 * 1024  # schema JSON text, EBNF, or the choice list as JSON
MAX_REGEX_CHARS = 16 * 1024
MAX_CHOICES = 2048


def grammar_bounds_error(spec: GrammarSpec) -> str | None:
    """What makes the spec too large to compile, or None; cheap (no parsing beyond a choice
    list that is already within the byte bound)."""
    size = len(spec.source.encode("utf-8", "surrogatepass"))
    if spec.kind == "regex" and len(spec.source) > MAX_REGEX_CHARS:
        return (f"{spec.param} has {len(spec.source)} characters; a regex may have at most "
                f"{MAX_REGEX_CHARS}")
    if size > MAX_GRAMMAR_BYTES:
        return (f"{spec.param} is {size} bytes; a grammar source may have at most "
                f"{MAX_GRAMMAR_BYTES}")
    if spec.kind == "choice":
        try:
            count = len(json.loads(spec.source))
        except (ValueError, TypeError):
            return f"{spec.param} must be a list of strings"
        if count > MAX_CHOICES:
            return f"{spec.param} has {count} entries; at most {MAX_CHOICES} are allowed"
    return None


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
        raise GrammarError(f"invalid {spec.kind} for {spec.param}: {first_line(exc)}") from exc


def check_grammar(spec: GrammarSpec) -> None:
    to_xgrammar(spec)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    # xgrammar prefixes "[hh:mm:ss] /path/file.cc:123: "; keep what it says
    line = text[-1] if text else type(exc).__name__
    return line.split(": ", 1)[-1] if line.startswith("[") else line
