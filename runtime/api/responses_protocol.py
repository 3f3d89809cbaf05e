"""Request body of ``POST /v1/responses`` (OpenAI's Responses API), validated by pydantic.

Fields that do not change the result (``store``, ``metadata``, ``include``, ``truncation``,
``reasoning``, ``service_tier``, ``background``) are accepted and ignored; a misspelt field is
still a 400 naming it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .protocol import JsonSchemaFormat, SamplingFields


class InputText(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")  # id, status: echoed back by clients
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: str
    output: str


InputItem = FunctionCallItem | FunctionCallOutputItem | MessageItem


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(JsonSchemaFormat):
    type: Literal["text", "json_object", "json_schema"] = "text"


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")  # verbosity
    format: TextFormat | None = None


class ResponsesRequest(SamplingFields):
    input: str | list[InputItem] = Field(union_mode="left_to_right")
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    # accepted, no effect on the result
    store: bool | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    background: bool | None = None
