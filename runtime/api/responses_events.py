"""The Responses API's objects and its stream of events, in the order the openai client and
agent SDKs parse: response.created, response.in_progress; per output item
output_item.added, then for a reasoning item (``--reasoning-parser``) content_part.added,
reasoning_text.delta..., reasoning_text.done, content_part.done, for a message
content_part.added, output_text.delta..., output_text.done, content_part.done, for a
function call function_call_arguments.delta..., function_call_arguments.done;
output_item.done; finally response.completed (its status is "incomplete" when
max_output_tokens cut it short). Every event has a sequence_number.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [output_text(text)] if status == "completed" else []}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [reasoning_text(text)] if status == "completed" else []}


def reasoning_text(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def response_object(response_id: str, created: int, model: str, echo: dict[str, Any],
                    output: list[dict[str, Any]], finish_reason: str | None,
                    usage: dict[str, Any] | None) -> dict[str, Any]:
    if finish_reason is None:
        status, incomplete = "in_progress", None
    elif finish_reason == "length":
        status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    else:
        status, incomplete = "completed", None
    return {"id": response_id, "object": "response", "created_at": created, "model": model,
            "status": status, "error": None, "incomplete_details": incomplete,
            "output": output, "usage": usage, "metadata": {}, "text": {"format": {"type": "text"}},
            "truncation": "disabled", "store": True, **echo}


class ResponseEvents:
    """Turns one choice's content and tool-call deltas (``ToolDeltaStream`` fields) into
    Responses events, tracking the open output item."""

    def __init__(self, skeleton: dict[str, Any]) -> None:
        self.skeleton = skeleton  # the response while in progress (no output yet)
        self.items: list[dict[str, Any]] = []  # finished output items
        self.started = False
        self._seq = 0
        self._open: dict[str, Any] | None = None
        self._text = ""  # of the open message, or the open call's arguments

    def start(self) -> list[dict[str, Any]]:
        self.started = True
        return [self._event("response.created", response=self.skeleton),
                self._event("response.in_progress", response=self.skeleton)]

    def fields(self, fields: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if fields.get("reasoning_content"):
            if self._open is None or self._open["type"] != "reasoning":
                out += self._close()
                out += self._open_item(reasoning_item(f"rs_{uuid.uuid4().hex}", "",
                                                      "in_progress"))
                out.append(self._event("response.content_part.added", **self._where(),
                                       content_index=0, part=reasoning_text("")))
            self._text += fields["reasoning_content"]
            out.append(self._event("response.reasoning_text.delta", **self._where(),
                                   content_index=0, delta=fields["reasoning_content"]))
        if fields.get("content"):
            if self._open is None or self._open["type"] != "message":
                out += self._close()
                out += self._open_item(message_item(f"msg_{uuid.uuid4().hex}", "",
                                                    "in_progress"))
                out.append(self._event("response.content_part.added", **self._where(),
                                       content_index=0, part=output_text("")))
            self._text += fields["content"]
            out.append(self._event("response.output_text.delta", **self._where(),
                                   content_index=0, delta=fields["content"], logprobs=[]))
        for call in fields.get("tool_calls", []):
            arguments = call.get("function", {}).get("arguments") or ""
            if "id" in call:
                out += self._close()
                out += self._open_item({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                                        "call_id": call["id"], "name": call["function"]["name"],
                                        "arguments": "", "status": "in_progress"})
            if arguments and self._open is not None:
                self._text += arguments
                out.append(self._event("response.function_call_arguments.delta",
                                       **self._where(), delta=arguments))
        return out

    def finish(self, final: Callable[[list[dict[str, Any]]], dict[str, Any]]
               ) -> list[dict[str, Any]]:
        """Close the open item, then the terminal event with ``final(output items)``."""
        out = self._close()
        # response.completed even when incomplete (status says so): the openai client's
        # stream helper and agent SDKs wait for exactly this event, as vLLM sends it
        return [*out, self._event("response.completed", response=final(self.items))]

    def _open_item(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self._open, self._text = item, ""
        return [self._event("response.output_item.added", output_index=len(self.items),
                            item=item)]

    def _close(self) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        out: list[dict[str, Any]] = []
        where = self._where()
        if item["type"] == "reasoning":
            part = reasoning_text(self._text)
            out.append(self._event("response.reasoning_text.done", **where, content_index=0,
                                   text=self._text))
            out.append(self._event("response.content_part.done", **where, content_index=0,
                                   part=part))
            done = {**item, "status": "completed", "content": [part]}
        elif item["type"] == "message":
            part = output_text(self._text)
            out.append(self._event("response.output_text.done", **where, content_index=0,
                                   text=self._text, logprobs=[]))
            out.append(self._event("response.content_part.done", **where, content_index=0,
                                   part=part))
            done = {**item, "status": "completed", "content": [part]}
        else:
            out.append(self._event("response.function_call_arguments.done", **where,
                                   name=item["name"], arguments=self._text))
            done = {**item, "status": "completed", "arguments": self._text}
        out.append(self._event("response.output_item.done", output_index=where["output_index"],
                               item=done))
        self.items.append(done)
        self._open, self._text = None, ""
        return out

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items)}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event
