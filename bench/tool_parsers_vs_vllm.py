"""Peer check: Shoal's ``--tool-call-parser`` formats read the same calls as vLLM's parsers.

    .venv/bin/python bench/tool_parsers_vs_vllm.py VLLM_VENV

Every case of tests/api/test_tool_formats.py (CASES) is given, whole, to vLLM's own parser
of the same name (mistral, qwen3_coder, pythonic, deepseek_v3, not openai; run in the vLLM venv with a
stand-in tokenizer that has the format's marker tokens) and to Shoal's; and every case of
tests/api/test_tool_parsers.py (BUILT_IN_CASES) to vLLM's hermes or llama3_json parser and to
Shoal's default reading (both formats tried on every text). The calls must agree
(names, and arguments as JSON values), and so must whether any call was found; a case on
which vLLM's parser raises counts as differing. Content is
compared after stripping (Shoal trims the text before the calls, vLLM keeps it). Exit 0 when
every case agrees; the cases that differ are printed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

VLLM_SIDE = r"""
import json, sys
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.deepseekv3_tool_parser import DeepSeekV3ToolParser
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from vllm.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from vllm.tool_parsers.mistral_tool_parser import MistralToolParser
from vllm.tool_parsers.pythonic_tool_parser import PythonicToolParser
from vllm.tool_parsers.qwen3_engine_tool_parser import Qwen3EngineToolParser

class Tokenizer:  # what the parsers look up: the vocabulary's marker tokens
    def __init__(self, markers):
        self.vocab = {m: 200000 + i for i, m in enumerate(markers)}
    def get_vocab(self):
        return self.vocab
    def encode(self, *args, **kwargs):
        return []
    def decode(self, *args, **kwargs):
        return ""
    def convert_ids_to_tokens(self, ids):
        return []

DS = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
      "<｜tool▁call▁end｜>"]
PARSERS = {
    # v11+ tokenizers have [ARGS]; the older ones write a JSON array after [TOOL_CALLS]
    "mistral": lambda: MistralToolParser(Tokenizer(["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"])),
    "mistral_pre_v11": lambda: MistralToolParser(Tokenizer(["[TOOL_CALLS]"])),
    "qwen3_coder": lambda: Qwen3EngineToolParser(Tokenizer(
        ["<tool_call>", "</tool_call>", "<think>", "</think>"])),
    "pythonic": lambda: PythonicToolParser(Tokenizer([])),
    "deepseek_v3": lambda: DeepSeekV3ToolParser(Tokenizer(DS)),
    "hermes": lambda: Hermes2ProToolParser(Tokenizer(["<tool_call>", "</tool_call>"])),
    "llama3_json": lambda: Llama3JsonToolParser(Tokenizer(["<|python_tag|>"])),
}
cases, tools = json.load(sys.stdin)
request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], model="m",
                                tools=tools)
def value(arguments):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return {"<not JSON>": arguments}

out = []
for name, text in cases:
    if name == "mistral" and "[ARGS]" not in text:
        name = "mistral_pre_v11"
    parser = PARSERS[name]()
    if name == "qwen3_coder":  # the engine parser types values by the request's tools
        parser = type(parser)(parser.model_tokenizer, tools=request.tools)
    try:
        got = parser.extract_tool_calls(text, request)
    except Exception as error:  # vLLM's parser raised: it reads no calls or content
        out.append({"raised": repr(error), "content": None, "calls": None})
        continue
    out.append({"content": got.content,
                "calls": [[c.function.name, value(c.function.arguments)]
                          for c in got.tool_calls] if got.tools_called else []})
print(json.dumps(out))
"""


def args_value(arguments: str):
    """As the vLLM side reads a call's arguments: JSON, or marked as not JSON."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return {"<not JSON>": arguments}


def test_module(name: str):
    spec = importlib.util.spec_from_file_location(
        f"tool_cases_{name}", ROOT / "tests" / "api" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_cases():  # -> (cases, TOOLS, departures) of both test modules
    formats, built_in = test_module("test_tool_formats"), test_module("test_tool_parsers")
    return (formats.CASES + built_in.BUILT_IN_CASES, formats.TOOLS,
            {**formats.DEPARTS_FROM_VLLM, **built_in.BUILT_IN_DEPARTS_FROM_VLLM})


def shoal_reading(name: str, text: str, tools):
    from shoal.runtime.api.tool_formats import BUILT_IN, parse_whole, tool_format
    from shoal.runtime.api.tool_parsers import parse_tool_calls

    if name in BUILT_IN:
        return parse_tool_calls(text)
    return parse_whole(tool_format(name, tools), text)  # type: ignore[arg-type]


def main(vllm_venv: str) -> int:
    cases, tools, departures = load_cases()
    # openai's cases are the harmony reading's call fragments: vLLM reads gpt-oss's calls
    # from token ids with openai_harmony (tests/api/test_harmony.py checks that reading)
    cases = [case for case in cases if case[0] != "openai"]
    result = subprocess.run(
        [str(Path(vllm_venv) / "bin" / "python"), "-c", VLLM_SIDE],
        input=json.dumps([[[name, text] for name, text, _, _ in cases], tools]),
        capture_output=True, text=True, timeout=600, cwd="/tmp")
    if result.returncode != 0:
        print(result.stderr[-4000:], file=sys.stderr)
        return 2
    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    differ = 0
    for (name, text, _, _), vllm in zip(cases, theirs, strict=True):
        content, calls = shoal_reading(name, text, tools)
        ours = [[c.name, args_value(c.arguments)] for c in calls]
        same = ours == vllm["calls"] and (
            (content or "").strip() == (vllm["content"] or "").strip() or not ours)
        known = not same and text in departures
        differ += not same and not known
        label = "same " if same else "known" if known else "DIFF "
        print(f"{label} {name:12} {text[:60]!r}"
              + ("" if same else f"\n    shoal: {content!r} {ours}\n    vllm:  "
                                 + vllm.get("raised", f"{vllm['content']!r} {vllm['calls']}")
                                 + (f"\n    ({departures[text]})" if known else "")))
    agree = sum(1 for (_, text, _, _) in cases) - differ - sum(
        1 for (_, text, _, _) in cases if text in departures)
    print(f"{agree}/{len(cases)} cases agree with vLLM's parsers, "
          f"{len(departures)} depart on purpose, {differ} differ otherwise")
    return 1 if differ else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tool_parsers_vs_vllm.py VLLM_VENV (a venv with vLLM's CPU build)")
    sys.exit(main(sys.argv[1]))
