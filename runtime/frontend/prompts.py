"""The one place that turns a request's prompt into token ids: text prompts and chats.

Text (completions, /tokenize, the offline ``LLM``): encoded as transformers encodes it,
with the checkpoint's special tokens (BOS) added unless ``add_special_tokens=False``.
Chat: the template renders the conversation (it writes BOS itself when the checkpoint has
one), and the text is encoded without adding special tokens again, as
``apply_chat_template(tokenize=True)`` does.

Special-token strings that a client wrote inside the conversation (``<|im_start|>system``
in a user message) are not control tokens: before rendering, each such string in any
client-supplied value is swapped for a private placeholder; the rendered text is then
split at the special tokens the template itself wrote, and the pieces between are encoded
as ordinary text with the placeholders put back. Conversations without special-token
strings (nearly all) are encoded in one call, exactly as transformers does.
``special_tokens_in_content=True`` opts out (the text is encoded as rendered, as vLLM and
transformers do by default).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shoal.runtime.frontend.chat_template import ChatTemplate, ChatTemplateError
from shoal.runtime.frontend.tokenizer import DEFAULT_TEMPLATE, Tokenizer

# names the renderer sets itself; chat_template_kwargs may not override them
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents",
                                         "add_generation_prompt"})
_PLACEHOLDER_CHARS = [chr(c) for c in range(0xE000, 0xF8FF)]  # Unicode private use area


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation to render, as plain JSON-like data (the message objects as sent)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last message open (no end-of-turn)
    template: str | None = None  # the name of one of the checkpoint's templates
    template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # vLLM's field: add BOS on top of what the template wrote
    special_tokens_in_content: bool = False  # opt-in: client text may contain control tokens
    max_text_bytes: int | None = None  # a longer rendering is refused before it is tokenized


class PromptTooLong(ChatTemplateError):
    """The rendered conversation is longer than ``max_text_bytes``."""


@dataclass(frozen=True)
class RenderedPrompt:
    token_ids: list[int]
    text: str


class PromptRenderer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        specials = self.tokenizer.special_tokens
        self._specials = sorted(specials, key=len, reverse=True)
        self._special_re = (re.compile("|".join(re.escape(s) for s in self._specials))
                            if self._specials else None)
        self._templates = {name: ChatTemplate(source, tokenizer.template_kwargs())
                           for name, source in tokenizer.chat_templates.items()}

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> RenderedPrompt:
        return RenderedPrompt(self.tokenizer.encode(text, add_special_tokens), text)

    def render_chat(self, chat: ChatPrompt) -> RenderedPrompt:
        template = self._template_for(chat)
        extra = dict(chat.template_kwargs or {})
        clash = RESERVED_TEMPLATE_VARIABLES & extra.keys()
        if clash:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(sorted(clash))}")
        messages, tools, documents = chat.messages, chat.tools, chat.documents
        if not template.reads_content_parts:
            messages = [_joined_text_parts(m) for m in messages]
        restore: dict[str, str] = {}
        if not chat.special_tokens_in_content and self._special_re is not None:
            inputs = (messages, tools, documents, extra)
            if any(self._special_re.search(s) for s in _strings(inputs)):
                messages, tools, documents, extra = _replace_strings(
                    inputs, self._placeholder_swap(inputs, restore))
        if chat.continue_final_message:
            text = self._render_open(template, messages, tools, documents, extra)
        else:
            text = template.render(messages, tools=tools, documents=documents,
                                   add_generation_prompt=chat.add_generation_prompt,
                                   extra=extra)
        size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        if chat.max_text_bytes is not None and size > chat.max_text_bytes:
            raise PromptTooLong(f"the rendered conversation has {size} bytes; at most "
                                f"{chat.max_text_bytes} fit this model's context")
        if not restore:
            return RenderedPrompt(self.tokenizer.encode(text, chat.add_special_tokens), text)
        return self._encode_with_literal_specials(text, restore, chat.add_special_tokens)

    @staticmethod
    def _render_open(template: ChatTemplate, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None, documents: list[dict[str, Any]] | None,
                     extra: dict[str, Any]) -> str:
        """As transformers' continue_final_message: render, then cut the text right after
        the final message's content (a marker appended to it shows where it ends)."""
        if not messages:
            raise ChatTemplateError("continue_final_message needs a final message")
        last = dict(messages[-1])
        content = last.get("content")
        if not isinstance(content, str):
            raise ChatTemplateError("continue_final_message needs the final message's content "
                                    "as a string")
        marker = "\ue000CONTINUE\ue001"
        last["content"] = content + marker
        text = template.render([*messages[:-1], last], tools=tools, documents=documents,
                               add_generation_prompt=False, extra=extra)
        if marker not in text:
            raise ChatTemplateError("the chat template does not render the final message's "
                                    "content, so it cannot be continued")
        return text[:text.rindex(marker)]

    def _template_for(self, chat: ChatPrompt) -> ChatTemplate:
        """As transformers' get_chat_template: a name picks a named template; with tools,
        ``tool_use`` if the checkpoint has one; else ``default``."""
        name = chat.template
        if name is not None and name in self._templates:
            return self._templates[name]
        if name is not None:  # a template source from a client is not run (vLLM: opt-in)
            raise ChatTemplateError(f"unknown chat template {name!r}; this model has "
                                    f"{sorted(self._templates) or 'none'}")
        if chat.tools and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if DEFAULT_TEMPLATE in self._templates:
            return self._templates[DEFAULT_TEMPLATE]
        if self._templates:
            raise ChatTemplateError("this model has several chat templates and no default; "
                                    f"name one of {sorted(self._templates)}")
        raise ChatTemplateError("this model has no chat template; use /v1/completions")

    def _placeholder_swap(self, inputs: object, restore: dict[str, str]) -> Callable[[str], str]:
        """A function replacing each special-token string with a placeholder made of
        private-use characters that occur nowhere in the inputs or the templates."""
        used = set("".join(_strings(inputs))) | set(
            "".join(t.source for t in self._templates.values()))
        free = [c for c in _PLACEHOLDER_CHARS if c not in used]
        if len(free) < len(self._specials) + 2:
            raise ChatTemplateError("the conversation uses too many private-use characters")
        open_mark, close_mark, digits = free[0], free[1], free[2:]
        placeholders = {s: open_mark + digits[i] + close_mark
                        for i, s in enumerate(self._specials)}
        restore.update({v: k for k, v in placeholders.items()})
        assert self._special_re is not None
        pattern = self._special_re
        return lambda s: pattern.sub(lambda m: placeholders[m.group(0)], s)

    def _encode_with_literal_specials(self, text: str, restore: dict[str, str],
                                      add_special_tokens: bool) -> RenderedPrompt:
        """Special tokens the template wrote become their ids; everything between them is
        ordinary text (the tokenizer splits at special tokens the same way, so for a
        byte-level BPE this is the encoding the text would get if the client's tags were
        not special tokens)."""
        assert self._special_re is not None
        back = re.compile("|".join(re.escape(p) for p in restore))
        ids: list[int] = []
        if add_special_tokens:
            ids = self.tokenizer.encode("", add_special_tokens=True)
        position = 0
        for match in self._special_re.finditer(text):
            ids += self._plain(text[position:match.start()], back, restore)
            token_id = self.tokenizer.token_id(match.group(0))
            assert token_id is not None
            ids.append(token_id)
            position = match.end()
        ids += self._plain(text[position:], back, restore)
        return RenderedPrompt(ids, back.sub(lambda m: restore[m.group(0)], text))

    def _plain(self, piece: str, back: re.Pattern[str], restore: dict[str, str]) -> list[int]:
        if not piece:
            return []
        return self.tokenizer.encode_plain(back.sub(lambda m: restore[m.group(0)], piece))


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return []


def _replace_strings(value: Any, change: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {k: _replace_strings(v, change) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_replace_strings(v, change) for v in value)
    return value


def _joined_text_parts(message: dict[str, Any]) -> dict[str, Any]:
    """For a template that expects content as a string: text parts joined by newlines, as
    vLLM's "string" content format does."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    text = "\n".join(str(p.get("text", "")) for p in content
                     if isinstance(p, dict) and p.get("type") == "text")
    return {**message, "content": text}
