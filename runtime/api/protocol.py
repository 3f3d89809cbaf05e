"""Request bodies of the OpenAI API (plus vLLM's extensions), validated by pydantic.

Every OpenAI and vLLM field a common client sends is declared here, and each is honoured,
accepted and ignored (it cannot change the result: ``IGNORED_FIELDS``, logged once), or
refused with a 400 naming it when its value would silently change the result
(``refused_fields``). A field nobody defines is still a 400 naming it (``extra="forbid"``),
so a misspelt parameter never becomes a silent default. docs/api-fields.md is the table.
These models are also what /openapi.json describes.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; accepted, usage comes once at the end


# accepted and ignored: none of them can change what is generated
IGNORED_FIELDS = ("metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                  "prediction", "verbosity", "reasoning_effort", "request_id")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: text (no constraint), any JSON object, or a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of these constraints."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(BaseModel):
    """Fields shared by both endpoints; ranges are checked by SamplingParams.validate."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    n: int = 1
    best_of: int | None = None  # accepted when it equals n (nothing to choose among)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> added to its logit
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # only True (what the decoder does)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N"
    prompt_logprobs: int | None = None  # vLLM: logprobs of every prompt token (first: None)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    user: str | None = None  # accepted (end-user id for abuse tracking); not used
    priority: int = 0
    cache_salt: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # accepted, ignored (IGNORED_FIELDS)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prediction: dict[str, Any] | None = None
    verbosity: str | None = None
    reasoning_effort: str | None = None
    request_id: str | None = None
    # vLLM's P/D disaggregation (runtime/kv_transfer/params.py), honoured with
    # --kv-transfer-config and ignored without one
    kv_transfer_params: dict[str, Any] | None = None
    # refused unless at their neutral value (refused_fields)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logits_processors: list[Any] | None = None
    vllm_xargs: dict[str, Any] | None = None

    def refused_fields(self) -> list[str]:
        """Fields whose value this server cannot honour and would otherwise silently drop."""
        refused = []
        if self.best_of is not None and self.best_of != self.n:
            refused.append("best_of")
        for name in ("use_beam_search",):
            if getattr(self, name):
                refused.append(name)
        if self.length_penalty != 1.0:
            refused.append("length_penalty")
        if not self.spaces_between_special_tokens:
            refused.append("spaces_between_special_tokens")
        for name in ("allowed_token_ids", "bad_words", "logits_processors", "vllm_xargs"):
            if getattr(self, name):
                refused.append(name)
        return refused

    def ignored_fields(self) -> list[str]:
        return [name for name in IGNORED_FIELDS if name in self.model_fields_set]


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(union_mode="left_to_right")
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False  # the prompt text prepended to each choice's text
    add_special_tokens: bool = True  # vLLM: BOS etc. added to text prompts, as HF encodes
    suffix: str | None = None  # refused (no insertion mode)

    def refused_fields(self) -> list[str]:
        return super().refused_fields() + (["suffix"] if self.suffix else [])


class ChatContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str


class ToolCall(BaseModel):
    """An assistant message's tool call, as the client sends it back with the history."""

    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant (reasoning models' earlier thoughts)
    reasoning: str | None = None  # the same under vLLM's newer name (answers carry both)
    refusal: str | None = None  # assistant (the openai client echoes it back)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_data(self) -> dict[str, Any]:
        """The message as the chat template sees it: the fields that were sent, an earlier
        reasoning under each name templates read (``reasoning_content``: Qwen3,
        DeepSeek; ``thinking``: gpt-oss's harmony template renders it as the analysis)."""
        data = self.model_dump(exclude_none=True, exclude={"refusal", "reasoning"})
        for call in data.get("tool_calls") or []:
            call["function"]["arguments"] = template_arguments(call["function"]["arguments"])
        thought = self.reasoning_content if self.reasoning_content is not None \
            else self.reasoning
        if thought is not None and self.role == "assistant":
            data["reasoning_content"] = thought
            data["thinking"] = thought
        return data


def template_arguments(arguments: str) -> Any:
    """A past call's arguments as templates take them (vLLM, transformers): the JSON
    object, not its text (gpt-oss's and Qwen3-Coder's templates read it as an object;
    others test ``is string``). Text that is not a JSON object or array stays text."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return value if isinstance(value, dict | list) else arguments


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None = no arguments
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM: the template already wrote BOS
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None  # the name of one of the checkpoint's templates
    chat_template_kwargs: dict[str, Any] | None = None
    # opt-in: special-token strings in message content act as control tokens (vLLM and
    # transformers treat them so by default; here they are ordinary text unless this is set)
    allow_special_tokens_in_content: bool = False
    echo: bool = False  # vLLM: prepend the last message's content (continue_final_message)
    modalities: list[str] | None = None  # only ["text"]
    audio: dict[str, Any] | None = None  # refused
    web_search_options: dict[str, Any] | None = None  # refused
    functions: list[dict[str, Any]] | None = None  # refused (deprecated; use tools)
    function_call: str | dict[str, Any] | None = None  # refused (deprecated; use tool_choice)

    def refused_fields(self) -> list[str]:
        refused = super().refused_fields()
        if self.modalities is not None and set(self.modalities) - {"text"}:
            refused.append("modalities")
        refused += [name for name in ("audio", "web_search_options", "functions",
                                      "function_call", "echo") if getattr(self, name)]
        return refused

    def ignored_fields(self) -> list[str]:
        return [name for name in super().ignored_fields() if name != "reasoning_effort"]

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs, with ``reasoning_effort`` as vLLM passes it (gpt-oss's
        template reads it); the kwargs' own value wins."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    tools: list[dict[str, Any]] | None = None  # as vLLM: what the chat's template would see
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    allow_special_tokens_in_content: bool = False
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings body plus vLLM's extensions (served with ``--runner pooling``)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] = Field(union_mode="left_to_right")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted, ignored (OpenAI's abuse tracking)
    add_special_tokens: bool = True  # vLLM: as HF encodes text inputs
    truncate_prompt_tokens: int | None = None  # vLLM: keep the last N tokens (-1: max_model_len)
    priority: int = 0  # vLLM: lower runs first under --scheduling-policy priority
    cache_salt: str | None = None  # vLLM: separates prefix-cache sharing
