"""LoRA adapters over HTTP, with vLLM's endpoints and bodies.

``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` parses and checks the adapter in the
engine (a bad one is a 400 naming why; the server goes on serving); ``POST
/v1/unload_lora_adapter {"lora_name"}`` stops new requests for it at once (requests already
running finish); an adapter not loaded is a 404. Both answer vLLM's plain-text success line.
``/v1/models`` lists each adapter with its ``parent`` (the base's served name) and ``root``
(its path).

As in vLLM, loading and unloading at run time is off unless the server's environment allows
it explicitly (``SHOAL_ALLOW_RUNTIME_LORA_UPDATING=1``, or vLLM's name
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): an adapter runs code-free but reads any path the server
can read and changes what clients of that name get, so it is an administrator's act. Off, both
endpoints answer 404 naming the variable. They are behind ``--api-key`` like every /v1 path,
on the main port and on ``--metrics-port`` alike.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict
from shoal.runtime.lora_modules import LoraModule

from .errors import APIError, bad_request
from .serving_common import parse_body
from .state import ServerState

LOAD_TIMEOUT_S = 300.0  # an adapter's files are read and checked in the engine
# ours first; vLLM's name is accepted so a vLLM deployment's environment carries over
RUNTIME_UPDATING_ENVS = ("SHOAL_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating_allowed(environ: Mapping[str, str]) -> bool:
    """Whether the environment allows loading and unloading adapters at run time: either
    variable set to ``1`` or ``true`` (vLLM's parsing; anything else, unset included, is no)."""
    return any(environ.get(name, "0").strip().lower() in ("1", "true")
               for name in RUNTIME_UPDATING_ENVS)


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter of that name


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are what identify adapters here


def _require_lora(state: ServerState) -> None:
    if not state.settings.allow_runtime_lora_updating:
        raise APIError(404, "loading and unloading LoRA adapters at run time is disabled on "
                       f"this server; start it with {RUNTIME_UPDATING_ENVS[0]}=1 (or "
                       f"{RUNTIME_UPDATING_ENVS[1]}=1) to allow it", None, "not_found")
    if not state.settings.enable_lora:
        raise bad_request("LoRA adapters are not enabled on this server (--enable-lora)")


def _not_found(name: str) -> APIError:
    return APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name",
                    "model_not_found")


async def load_lora_adapter(request: Request, state: ServerState) -> PlainTextResponse:
    _require_lora(state)
    body = await parse_body(request, state, LoadLoraAdapterRequest)
    name, path = body.lora_name.strip(), body.lora_path.strip()
    if not name or not path:
        raise bad_request("lora_name and lora_path must not be empty")
    if name in state.settings.served_model_names:
        raise bad_request(f"'{name}' is the base model's name", "lora_name")
    if name in state.adapters:
        if not body.load_inplace:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.",
                              "lora_name")
        await _unload(state, name)
    reply = await state.client.call_utility("add_lora", LOAD_TIMEOUT_S, [name, path])
    if not reply.ok:
        raise bad_request(f"could not load LoRA adapter '{name}': {reply.result}", "lora_path")
    state.adapters[name] = LoraModule(name, path)
    state.metrics.set_adapters(list(state.adapters))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request, state: ServerState) -> PlainTextResponse:
    _require_lora(state)
    body = await parse_body(request, state, UnloadLoraAdapterRequest)
    name = body.lora_name.strip()
    if name not in state.adapters:
        raise _not_found(name)
    await _unload(state, name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _unload(state: ServerState, name: str) -> None:
    reply = await state.client.call_utility("remove_lora", LOAD_TIMEOUT_S, [name])
    state.adapters.pop(name, None)  # either way it no longer serves new requests
    state.metrics.set_adapters(list(state.adapters))
    if not reply.ok and reply.result != "not found":
        raise bad_request(f"could not unload LoRA adapter '{name}': {reply.result}",
                          "lora_name")


def model_cards(state: ServerState) -> list[dict]:
    """``/v1/models``: the base under each served name, then each adapter."""
    settings = state.settings
    cards = [{"id": name, "object": "model", "created": 0, "owned_by": "shoal",
              "root": settings.model_dir, "parent": None, "max_model_len": state.max_model_len,
              "quantization": state.quantization}
             for name in settings.served_model_names]
    for module in state.adapters.values():
        cards.append({"id": module.name, "object": "model", "created": 0, "owned_by": "shoal",
                      "root": module.path,
                      "parent": module.base_model_name or settings.model_name,
                      "max_model_len": state.max_model_len})
    return cards


# what --metrics-port passes on to the main app (with its API-key check) under --enable-lora
ADMIN_PATHS = ("/v1/models", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
