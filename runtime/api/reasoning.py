"""Reasoning output (``--reasoning-parser``): the ``<think>...</think>`` span a reasoning model
writes before its answer, split from the content, whole or as it streams.

Two parsers, as vLLM names them: ``qwen3`` (Qwen3, QwQ: the model opens ``<think>`` itself,
unless the template already did; output with no ``<think>`` is all content, e.g. with
``enable_thinking: false``) and ``deepseek_r1`` (DeepSeek-R1 and its distills: the template
opens the span, so the output is reasoning until ``</think>``, all of it when cut short).
Either way the span is open from the first token when the rendered prompt ends with
``<think>``. The chat answer carries the span as ``reasoning_content`` and ``reasoning``
(vLLM renamed the field and restored the old one after clients broke: both are sent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1", "openai_gptoss")  # the last: harmony.py


class TextSplitter(Protocol):
    """Output text in, (reasoning, content) pieces out, as it streams."""

    saw_reasoning: bool

    def feed(self, text: str) -> tuple[str, str]: ...

    def finish(self) -> tuple[str, str]: ...


@dataclass(frozen=True)
class ReasoningFormat:
    """How one request's output begins: open (already reasoning) or not yet; and whether a
    grammar waits for ``</think>`` (not when the prompt already closed the span, as Qwen3's
    template does for ``enable_thinking: false``)."""

    parser: str
    starts_open: bool
    grammar_deferred: bool = True
    end_marker: str = THINK_END  # where the reasoning has surely ended (a grammar starts)

    def stream(self) -> TextSplitter:
        return ReasoningStream(self)

    def reasoning_tokens(self, text: str, output_ids: list[int], tokenizer) -> int:
        """How many of the output's tokens (``text`` decoded) were reasoning."""
        return reasoning_token_count(output_ids, tokenizer.encode(
            self.end_marker, add_special_tokens=False), self.split(text)[0] is not None)

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole output; reasoning None when there was none."""
        stream = self.stream()
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        reasoning += more_reasoning
        content += more_content
        return (reasoning if stream.saw_reasoning else None), content


def reasoning_format(parser: str | None, prompt_text: str | None) -> ReasoningFormat | None:
    if parser is None:
        return None
    tail = (prompt_text or "").rstrip()
    closed = tail.endswith(THINK_END)
    opened = tail.endswith(THINK_START) or (parser == "deepseek_r1" and not closed)
    return ReasoningFormat(parser, opened, grammar_deferred=not closed)


def reasoning_token_count(output_ids: list[int], end_ids: list[int], had_reasoning: bool) -> int:
    """The output tokens up to and including the span's end marker (all of them when the
    output was cut short inside the span); 0 without reasoning. Exact when ``</think>`` is
    one token (Qwen3, DeepSeek-R1); otherwise where its encoding first appears."""
    if not had_reasoning:
        return 0
    n = len(end_ids)
    for end in range(n, len(output_ids) + 1):
        if n and output_ids[end - n:end] == end_ids:
            return end
    return len(output_ids)


def _partial_suffix(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could begin ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Text in, (reasoning, content) pieces out; a partial ``<think>`` / ``</think>`` is held
    back until the next piece says what it is, so markup never leaks into either field."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.state = "start"
        self.starts_open = fmt.starts_open
        self.saw_reasoning = fmt.starts_open
        self.ended = False  # the span closed: the rest is content
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        text = self._held + text
        self._held = ""
        reasoning = content = ""
        while text:
            if self.state == "start":  # leading whitespace, then maybe <think> (even when
                # the template opened the span, some models write it again)
                stripped = text.lstrip()
                if not stripped:
                    self._held = text
                    return reasoning, content
                if stripped.startswith(THINK_START):
                    self.state, self.saw_reasoning = "reasoning", True
                    text = stripped[len(THINK_START):]
                elif THINK_START.startswith(stripped):
                    self._held = text
                    return reasoning, content
                else:
                    self.state = "reasoning" if self.starts_open else "content"
            elif self.state == "reasoning":
                end = text.find(THINK_END)
                if end >= 0:
                    reasoning += text[:end]
                    text = text[end + len(THINK_END):].lstrip("\n")
                    self.state, self.ended = "content", True
                    if not text:
                        self.state = "after"  # newlines right after </think> are dropped
                    continue
                keep = _partial_suffix(text, THINK_END)
                reasoning += text[:len(text) - keep]
                self._held = text[len(text) - keep:]
                return reasoning, content
            elif self.state == "after":
                text = text.lstrip("\n")
                if text:
                    self.state = "content"
            else:
                content += text
                text = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held when the output ends: a partial marker is plain text after all."""
        held, self._held = self._held, ""
        if self.state == "reasoning" or (self.state == "start" and self.starts_open):
            return held, ""
        return "", held if self.state != "after" else ""


def reasoning_fields(reasoning: str) -> dict[str, str]:
    """A chat message's or delta's reasoning, under both of vLLM's names."""
    return {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}
