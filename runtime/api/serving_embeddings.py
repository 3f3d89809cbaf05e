"""POST /v1/embeddings (``--runner pooling``): each input's prompt pooled by the engine as the
checkpoint says (``runtime/pooling_config.py``), then cut to ``dimensions`` and normalised
here, per request, as vLLM orders them (cut first, so a shorter vector is unit length too).

Inputs as OpenAI takes them: a string, a list of strings, a list of token ids, or a list of
token-id lists; each is one engine request of one placeholder token (nothing is sampled),
all admitted together. ``encoding_format: base64`` is the little-endian float32 bytes the
openai client decodes with ``numpy.frombuffer`` (its default request)."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from shoal.runtime.pooling_config import PoolerConfig
from shoal.runtime.sampling_params import SamplingParams

from .errors import bad_request
from .generation import Generation, PromptInput
from .protocol import EmbeddingRequest
from .serving_common import (
    check_prompt_text,
    now_s,
    parse_body,
    run_to_completion,
    start_generation,
    truncated,
)
from .state import ServerState

# nothing is sampled: one placeholder token ends each request after its prompt
POOLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def embedding_inputs(body: EmbeddingRequest, state: ServerState) -> list[PromptInput]:
    """Runs in a worker thread (text is tokenized)."""
    given: list = [body.input] if isinstance(body.input, str) else list(body.input)
    if not given:
        raise bad_request("the input is empty", "input")
    if all(isinstance(t, int) for t in given):
        given = [given]  # one token-id input
    max_n = state.settings.limits.max_n
    if len(given) > max_n:
        raise bad_request(f"{len(given)} inputs; the limit is {max_n} (--max-n)", "input")
    prompts = []
    for item in given:
        if isinstance(item, str):
            check_prompt_text(state, item, "input")
            rendered = state.renderer.encode_text(item, body.add_special_tokens)
            prompts.append(PromptInput(rendered.token_ids, rendered.text))
        else:
            prompts.append(PromptInput(list(item)))
        if not prompts[-1].token_ids:
            raise bad_request("an input has no tokens", "input")
    return prompts


def check_dimensions(dimensions: int | None, pooler: PoolerConfig, model: str) -> None:
    if dimensions is None:
        return
    if not pooler.matryoshka:
        raise bad_request(f"Model {model!r} does not support matryoshka representation "
                          "(is_matryoshka or matryoshka_dimensions in its config.json); "
                          "changing output dimensions would give poor results", "dimensions")
    if pooler.matryoshka_dimensions and dimensions not in pooler.matryoshka_dimensions:
        raise bad_request(f"Model {model!r} only supports dimensions "
                          f"{list(pooler.matryoshka_dimensions)}, got {dimensions}",
                          "dimensions")
    if dimensions < 1 or (pooler.hidden_size and dimensions > pooler.hidden_size):
        raise bad_request(f"dimensions must be in [1, {pooler.hidden_size}], got {dimensions}",
                          "dimensions")


def finish_vector(raw: bytes, dimensions: int | None, normalize: bool) -> np.ndarray:
    vector = np.frombuffer(raw, dtype=np.float32)
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:  # as torch.nn.functional.normalize: divided by max(norm, 1e-12)
        vector = vector / max(float(np.linalg.norm(vector.astype(np.float64))), 1e-12)
    return vector.astype(np.float32)


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def create_embedding(request: Request, state: ServerState) -> Response:
    body = await parse_body(request, state, EmbeddingRequest)
    pooler = state.settings.pooler
    if pooler is None:
        raise bad_request(f"Model {state.settings.model_name!r} generates text; embeddings "
                          "need an embedding checkpoint served with --runner pooling", "model")
    check_dimensions(body.dimensions, pooler, state.settings.model_name)
    prompts = [truncated(p, body.truncate_prompt_tokens, state)
               for p in await asyncio.to_thread(embedding_inputs, body, state)]
    generation = start_generation(request, state, "embd", prompts, POOLING_PARAMS, body)
    created, model = now_s(), state.settings.model_name

    def respond(gen: Generation) -> dict:
        data = []
        for choice in gen.choices:
            if choice.pooled is None:  # the engine always sends it with the first output
                raise RuntimeError(f"{gen.request_id}: no pooled vector for input "
                                   f"{choice.index}")
            vector = finish_vector(choice.pooled, body.dimensions, pooler.normalize)
            data.append({"object": "embedding", "index": choice.index,
                         "embedding": encode_vector(vector, body.encoding_format)})
        prompt_tokens = sum(len(c.prompt.token_ids) for c in gen.choices)
        return {"id": gen.request_id, "object": "list", "created": created, "model": model,
                "data": data,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}

    return await run_to_completion(request, state, generation, respond)
