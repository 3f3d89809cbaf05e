"""What a request's prefix is, as a chain of block keys the router can match.

Two modes. Token-precise (the router has the model's tokenizer, or the prompt is already
token ids): the prompt becomes the engine's own token ids (the chat template for chat
requests) and every full block is hashed with ``block_hash.hash_prefix_blocks`` using the
engine's block size and extra keys, so the keys are the engine's block hashes and can be
matched against its KV events. Approximate (no tokenizer): the prompt text is cut into
fixed character chunks (about one block of tokens each) and chained with xxhash, so two
prompts share leading keys exactly when they share leading text.

Chat requests render the conversation so far in order, so a follow-up turn's keys extend
the previous turn's: the same user keeps matching where their history is cached.

Keying never raises past ``keys_or_none``: the body is decoded with a nesting bound (msgspec,
C; then an iterative depth walk) and token ids are range-checked before hashing, and any
failure means "route by load alone"; the engine then answers the body with its own 4xx.
``MalformedBody`` marks bodies no engine accepts (not JSON, nested too deep, ids outside
[0, 2**32)): the endpoint picker answers those with an immediate 400 itself.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import xxhash
from shoal.runtime.frontend.tokenizer import Tokenizer
from shoal.runtime.kv.block_hash import ExtraKeys, effective_cache_salt, hash_prefix_blocks

from shoal.contract.kv import DEFAULT_BLOCK_SIZE

DEFAULT_CHARS_PER_BLOCK = 64  # ~16 tokens of English-like text at ~4 characters per token
MAX_PREFIX_BLOCKS = 4096  # longer prompts are keyed on their first 4096 blocks only
MAX_JSON_DEPTH = 64  # the engines' --max-json-depth default: deeper bodies get their 400
MAX_TOKEN_ID = 2**32 - 1  # no vocabulary is larger; beyond this an id cannot be real

log = logging.getLogger("shoal.router.keys")


class RequestKeyError(ValueError):
    """The request body is not a completion or chat request the router can key."""


class MalformedBody(RequestKeyError):
    """A body no engine accepts (not JSON, nested past MAX_JSON_DEPTH, token ids out of
    range): 400 whoever answers it."""


def decode_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON body, or ``MalformedBody``; never RecursionError (msgspec decodes in C and
    the depth is measured iteratively)."""
    try:
        data = msgspec.json.decode(raw)
    except RecursionError:
        raise MalformedBody(f"the body is nested more than {max_depth} levels deep") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedBody(f"the body is not valid JSON: {exc}") from None
    if json_depth(data, max_depth) > max_depth:
        raise MalformedBody(f"the body is nested more than {max_depth} levels deep")
    return data


def json_depth(data: object, stop_after: int) -> int:
    """Nesting depth of containers (a scalar is 0), without recursion; stops past
    ``stop_after``."""
    deepest = 0
    stack: list[tuple[object, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        children: Sequence[object]
        if isinstance(value, dict):
            children = list(value.values())
        elif isinstance(value, list):
            children = value
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        if deepest > stop_after:
            return deepest
        stack.extend((child, depth) for child in children)
    return deepest


@dataclass(frozen=True)
class RequestKeys:
    block_keys: list[int]  # chained: key i covers everything up to the end of block i
    precise: bool  # keys are engine block hashes (token-precise)
    num_units: int  # tokens (precise) or characters (approximate) of the prompt
    ring_key: int  # the prompt's home on the hash ring: its first block, or all of it if shorter


class PromptTokenizer:
    """The model's tokenizer and chat templates, applied by the engine front end's own
    renderer (frontend/prompts.py), so precise keys are over the very ids the engine runs:
    text prompts with the special tokens HF adds (unless the body says
    ``add_special_tokens: false``), chats rendered with the message objects as sent."""

    def __init__(self, tokenizer: Tokenizer | str | Path) -> None:
        """``tokenizer``: a model dir, or a ``Tokenizer`` (say, fetched from an engine)."""
        from shoal.runtime.frontend.prompts import PromptRenderer

        self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) \
            else Tokenizer.from_dir(tokenizer)
        self._renderer = PromptRenderer(self.tokenizer)

    def encode_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self._renderer.encode_text(prompt, add_special_tokens).token_ids

    def encode_chat(self, messages: list[dict[str, Any]], body: dict[str, Any] | None = None
                    ) -> list[int]:
        from shoal.runtime.frontend.chat_template import ChatTemplateError
        from shoal.runtime.frontend.prompts import ChatPrompt

        body = body or {}
        try:
            return self._renderer.render_chat(ChatPrompt(
                [{k: v for k, v in m.items() if v is not None and k != "refusal"}
                 for m in messages if isinstance(m, dict)], tools=body.get("tools"),
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
                template=body.get("chat_template"),
                template_kwargs=body.get("chat_template_kwargs"),
                add_special_tokens=bool(body.get("add_special_tokens", False)),
                special_tokens_in_content=bool(
                    body.get("allow_special_tokens_in_content", False)))).token_ids
        except ChatTemplateError as exc:
            raise RequestKeyError(str(exc)) from exc


def _content_text(content: Any) -> str:
    """OpenAI content: a string, or parts of which the text parts count, in order."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


@dataclass(frozen=True)
class KeyConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    chars_per_block: int = DEFAULT_CHARS_PER_BLOCK
    model_revision: str = ""
    # the engines' --cache-sharing: tenant salts a request's blocks by its tenant, as they do
    per_tenant_cache: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.chars_per_block < 1:
            raise ValueError("block_size and chars_per_block must be >= 1")


def render_chat_text(messages: Sequence[Any]) -> str:
    """A canonical text of a conversation; earlier turns are a prefix of later renderings."""
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            raise RequestKeyError("each chat message must be an object")
        content = _content_text(message.get("content"))
        parts.append(f"\x1e{message.get('role', '')}\x1f{content}")
    return "".join(parts)


def text_block_keys(text: str, chars_per_block: int, extra: bytes) -> list[int]:
    """Chained hashes of every full ``chars_per_block`` chunk of ``text``."""
    num_full = min(len(text) // chars_per_block, MAX_PREFIX_BLOCKS)
    keys: list[int] = []
    parent = 0
    # chunk on characters, not bytes, so a multibyte character never splits a block
    for i in range(num_full):
        chunk = text[i * chars_per_block:(i + 1) * chars_per_block].encode(
            "utf-8", errors="surrogatepass")
        h = xxhash.xxh64()
        h.update(parent.to_bytes(8, "little"))
        h.update(extra)
        h.update(chunk)
        parent = h.intdigest()
        keys.append(parent)
    return keys


def _token_id_prompt(prompt: Any) -> list[int] | None:
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        if not all(0 <= t <= MAX_TOKEN_ID for t in prompt):
            raise MalformedBody(f"token ids must be in [0, {MAX_TOKEN_ID}]")
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        return _token_id_prompt(prompt[0])
    return None


def request_keys(path: str, body: dict[str, Any], config: KeyConfig,
                 tokenizer: PromptTokenizer | None = None,
                 tenant: str | None = None, adapter: str | None = None) -> RequestKeys:
    """Block keys of the request's prompt. ``path`` picks chat vs completion semantics;
    ``tenant`` is the identity the router forwards to the engines, which salt by it;
    ``adapter``: the LoRA adapter it runs on (``lora_affinity.adapter_for_keys``), whose
    name the engines hash its blocks with."""
    if not isinstance(body, dict):
        raise RequestKeyError("request body must be a JSON object")
    salt = effective_cache_salt(tenant if config.per_tenant_cache else None,
                                body.get("cache_salt"))
    extra = ExtraKeys(config.model_revision, adapter, salt).digest()
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise RequestKeyError("chat request needs a 'messages' list")
        if tokenizer is not None:
            return _precise(tokenizer.encode_chat(messages, body), config, extra)
        return _approximate(render_chat_text(messages), config, extra)
    prompt = body.get("prompt")
    token_ids = _token_id_prompt(prompt)
    if token_ids is not None:
        return _precise(token_ids, config, extra)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):  # several prompts: key on the first, they usually share it
        prompt = prompt[0] if prompt and isinstance(prompt[0], str) else ""
    if not isinstance(prompt, str):
        raise RequestKeyError("completion request needs a 'prompt' string or token ids")
    if tokenizer is not None:
        return _precise(tokenizer.encode_prompt(
            prompt, bool(body.get("add_special_tokens", True))), config, extra)
    return _approximate(prompt, config, extra)


def keys_of_body(path: str, raw: bytes, config: KeyConfig,
                 tokenizer: PromptTokenizer | None = None, tenant: str | None = None,
                 adapter: str | None = None) -> RequestKeys | MalformedBody | None:
    """``request_keys`` of a raw body; a ``MalformedBody`` (returned, not raised) for a body
    no engine accepts; None when it cannot be keyed otherwise (route by load: the engine
    judges it). Nothing raises out of here: keying is an optimisation, never a 5xx."""
    try:
        return request_keys(path, decode_body(raw), config, tokenizer, tenant, adapter)
    except MalformedBody as exc:
        return exc
    except RequestKeyError:
        return None
    except Exception as exc:  # noqa: BLE001 (a template or tokenizer failure: load-only)
        log.debug("request keying failed (%r); routing by load", exc)
        return None


def keys_or_none(path: str, raw: bytes, config: KeyConfig,
                 tokenizer: PromptTokenizer | None = None, tenant: str | None = None,
                 adapter: str | None = None) -> RequestKeys | None:
    keys = keys_of_body(path, raw, config, tokenizer, tenant, adapter)
    return keys if isinstance(keys, RequestKeys) else None


def _precise(token_ids: list[int], config: KeyConfig, extra: bytes) -> RequestKeys:
    keys = hash_prefix_blocks(token_ids, config.block_size, extra, max_blocks=MAX_PREFIX_BLOCKS)
    ring_key = keys[0] if keys else xxhash.xxh64_intdigest(
        extra + np.asarray(token_ids, dtype=np.int64).tobytes())
    return RequestKeys(keys, True, len(token_ids), ring_key)


def _approximate(text: str, config: KeyConfig, extra: bytes) -> RequestKeys:
    keys = text_block_keys(text, config.chars_per_block, extra)
    ring_key = keys[0] if keys else xxhash.xxh64_intdigest(
        extra + text.encode("utf-8", errors="surrogatepass"))
    return RequestKeys(keys, False, len(text), ring_key)
