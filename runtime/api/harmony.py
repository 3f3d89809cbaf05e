"""gpt-oss's output format, "harmony" (``--reasoning-parser openai_gptoss``, ``--tool-call-parser
openai``; without them too for a ``gpt_oss`` checkpoint with harmony's tokens, as vLLM
reads gpt-oss: ``reads_harmony``): the model writes messages, each a header
then a body::

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>

(the prompt ends with ``<|start|>assistant``, so the first header has no role). A header
names a channel (``<|channel|>NAME``), maybe a recipient (`` to=NAME``, before or after the
channel) and a content type (``<|constrain|>json`` or a bare word after the channel). A body
ends at ``<|end|>``, ``<|return|>`` (the answer is done) or ``<|call|>`` (a tool call is done).
Each message is, as vLLM reads them: a recipient ``functions.NAME`` -> a tool call whose
arguments are the body; else channel ``analysis`` -> reasoning; ``final``, or ``commentary``
with no recipient (a preamble) -> content; any other recipient (built-in browser/python
tools, which this server does not run) -> dropped. Several messages of one kind are joined
with a newline. A header with no channel is read as content: a model that ignores the
format loses nothing.

The reading is on text with the special tokens kept (the request is detokenized with
``skip_special_tokens`` off). Calls leave here as a canonical fragment
(``tool_formats/openai.py``) that the tool-call stream reads like any other format, so
chat, Responses and Messages stream them as they stream every format's calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .reasoning import ReasoningFormat
from .tool_formats.openai import CALL_END, call_start

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
TERMINATORS = (END, RETURN, CALL)
HARMONY_PARSER = "openai_gptoss"
# the grammar of a structured output or a forced tool starts in the final channel
FINAL_MARKER = CHANNEL + "final" + MESSAGE

_RECIPIENT = re.compile(r"to=([^\s<]+)")
_WORD = re.compile(r"[^\s<]+")


@dataclass(frozen=True)
class Header:
    channel: str | None
    recipient: str | None
    content_type: str | None

    @property
    def kind(self) -> str:
        """"call" | "reasoning" | "content" | "ignore" (vLLM's routing of a message)."""
        if self.recipient is not None:
            return "call" if self.recipient.startswith("functions.") else "ignore"
        if self.channel == "analysis":
            return "reasoning"
        if self.channel in (None, "final", "commentary"):
            return "content"
        return "ignore"

    @property
    def function(self) -> str:
        return (self.recipient or "").removeprefix("functions.")


def parse_header(text: str) -> Header:
    """A header's text, from after ``<|start|>`` (or the output's start) to ``<|message|>``."""
    text = text.removeprefix(START)
    match = _RECIPIENT.search(text)
    recipient = match.group(1) if match else None
    rest = _RECIPIENT.sub(" ", text)
    channel = content_type = None
    if CHANNEL in rest:
        after = rest.split(CHANNEL, 1)[1]
        if CONSTRAIN in after:
            after, constrained = after.split(CONSTRAIN, 1)
            word = _WORD.search(constrained)
            content_type = word.group(0) if word else None
        words = _WORD.findall(after)
        channel = words[0] if words else None
        if content_type is None and len(words) > 1:
            content_type = words[1]
    return Header(channel, recipient, content_type)


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could begin one of ``markers``."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best


class HarmonyStream:
    """Harmony text in, (reasoning, content) pieces out; content carries the calls as
    canonical fragments when ``keep_calls``. Markup never reaches either field: a partial
    marker is held until the next piece says what it is."""

    def __init__(self, fmt: HarmonyFormat) -> None:
        self.keep_reasoning = fmt.keep_reasoning
        self.keep_calls = fmt.keep_calls
        self.saw_reasoning = False
        self.messages = 0  # messages whose body began
        self._header: str | None = ""  # the header so far; None inside a body
        self._prompt_part = 0  # how much of the header the prompt wrote
        self._kind = ""
        self._held = ""
        self._wrote: set[str] = set()  # kinds (reasoning, content) that have text already
        self._new_message = False  # the body began: a separator may be due
        self.feed(fmt.prompt_tail)  # where the prompt left off (normally in a header)
        self._prompt_part = len(self._header) if self._header is not None else 0

    def feed(self, text: str) -> tuple[str, str]:
        text = self._held + text
        self._held = ""
        out = {"reasoning": "", "content": ""}
        while text:
            if self._header is not None:
                at = text.find(MESSAGE)
                if at < 0:
                    keep = _held(text, (MESSAGE,))
                    self._header += text[:len(text) - keep]
                    self._held = text[len(text) - keep:]
                    break
                self._begin(parse_header(self._header + text[:at]), out)
                text = text[at + len(MESSAGE):]
                continue
            ends = [(at, marker) for marker in TERMINATORS if (at := text.find(marker)) >= 0]
            if ends:
                at, marker = min(ends)
                self._body(text[:at], out)
                self._close(out)
                text = text[at + len(marker):]
                continue
            keep = _held(text, TERMINATORS)
            self._body(text[:len(text) - keep], out)
            self._held = text[len(text) - keep:]
            break
        return out["reasoning"], out["content"]

    def finish(self) -> tuple[str, str]:
        """The output ended: a body cut short counts as written (a call with the arguments
        it has); a header that never began a body is dropped, unless nothing in the output
        was harmony at all (then it is all content)."""
        held, self._held = self._held, ""
        out = {"reasoning": "", "content": ""}
        if self._header is None:
            self._body(held, out)
            self._close(out)
        else:
            written = self._header[self._prompt_part:] + held
            if self.messages == 0 and "<|" not in written:
                out["content"] = written
            self._header = ""
        return out["reasoning"], out["content"]

    @property
    def kind(self) -> str:
        """The open body's kind ("" between messages)."""
        return self._kind

    def _begin(self, header: Header, out: dict[str, str]) -> None:
        self._header, self._kind, self._new_message = None, header.kind, True
        self.messages += 1
        if self._kind == "reasoning" and self.keep_reasoning:
            self.saw_reasoning = True
        if self._kind == "call" and self.keep_calls:
            out["content"] += call_start(header.function)

    def _body(self, text: str, out: dict[str, str]) -> None:
        if not text:
            return
        kind = self._kind
        if kind == "call":
            if self.keep_calls:
                out["content"] += text
            return
        if kind == "ignore" or (kind == "reasoning" and not self.keep_reasoning):
            return
        if self._new_message and kind in self._wrote:
            text = "\n" + text
        self._new_message = False
        self._wrote.add(kind)
        out[kind] += text

    def _close(self, out: dict[str, str]) -> None:
        if self._kind == "call" and self.keep_calls:
            out["content"] += CALL_END
        self._header, self._kind = "", ""


@dataclass(frozen=True)
class HarmonyFormat(ReasoningFormat):
    """One request's harmony reading: whether reasoning is reported (``--reasoning-parser
    openai_gptoss``) and calls read (``--tool-call-parser openai`` with ``tool_choice``
    auto), and where the prompt left off."""

    prompt_tail: str = ""
    keep_reasoning: bool = True
    keep_calls: bool = False
    end_marker: str = FINAL_MARKER

    def stream(self) -> HarmonyStream:
        return HarmonyStream(self)

    def reasoning_tokens(self, text: str, output_ids: list[int], tokenizer) -> int:
        """The output tokens from the start to the end of the last analysis message (its
        headers and end marker included); 0 without one. The analysis comes first in
        gpt-oss's output, so this is vLLM's count of the analysis tokens."""
        stream = HarmonyStream(HarmonyFormat(self.parser, False, prompt_tail=self.prompt_tail))
        count = 0
        for i, token_id in enumerate(output_ids):
            before = stream.kind
            stream.feed(tokenizer.decode([token_id], skip_special_tokens=False))
            if stream.kind == "reasoning" or before == "reasoning":
                count = i + 1
        return count


def reads_harmony(reasoning_parser: str | None, tool_call_parser: str | None,
                  model_type: str, tokenizer) -> bool:
    """Whether outputs are read as harmony: with either flag; and, as vLLM does for gpt-oss,
    for a ``gpt_oss`` checkpoint whose tokenizer has harmony's tokens when neither flag
    names another format (then the content is the final channel, reasoning not reported)."""
    if reasoning_parser == HARMONY_PARSER or tool_call_parser == "openai":
        return True
    return (model_type == "gpt_oss" and reasoning_parser is None and tool_call_parser is None
            and all(tokenizer.token_id(t) is not None for t in (START, CHANNEL, MESSAGE, END)))


def harmony_format(prompt_text: str | None, keep_reasoning: bool,
                   keep_calls: bool) -> HarmonyFormat:
    """Where the rendered prompt left the model: after its last ``<|start|>``."""
    text = prompt_text or ""
    at = text.rfind(START)
    tail = text[at:] if at >= 0 else ""
    if any(marker in tail for marker in TERMINATORS):
        tail = ""
    return HarmonyFormat(HARMONY_PARSER, starts_open=False, prompt_tail=tail,
                         keep_reasoning=keep_reasoning, keep_calls=keep_calls)
