"""LoRA affinity: a request for an adapter goes where the adapter is loaded.

Engines export ``lora_requests_info`` (``shoal.contract.metrics.LoraInfo``: their slots and
the adapters running or waiting in them), as the Gateway API inference extension's
model-server protocol and llm-d's lora-affinity scorer read it. Before the routing policy
(cache affinity, bounded load) chooses, the candidates are narrowed, in order:
0. to the replicas that serve the adapter at all (``lora_adapter_info``), when any does;
1. replicas with the adapter active and no queue of their own;
2. else replicas with a free adapter slot (they load it without evicting a running one);
3. else replicas with the adapter active, queue or not;
4. else all of them.
So a replica that would have to load the adapter is chosen only when none that holds it has
room. A request for the base model, or for a name no replica reports (LoRA off everywhere),
is not narrowed at all. Pure: no I/O.

A request's prefix keys are salted by its adapter (``adapter_for_keys``): the engines hash an
adapter's blocks with its name (``ExtraKeys.adapter_id``, as vLLM's block hashes include the
LoRA id), since the same prompt under two adapters is different KV. Unsalted, cache affinity
would send an adapter's request after the base's cached prefix (or another adapter's), where
it matches nothing, and in token-precise mode its keys would never meet the engines' events.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec
from shoal.runtime.router.policies.base import ReplicaSnapshot

from shoal.contract.metrics import LoraInfo


class _ModelField(msgspec.Struct):
    model: str | None = None


_decoder = msgspec.json.Decoder(_ModelField)


def model_of(body: bytes) -> str | None:
    """The body's ``model``; None when it has none or is not a JSON object (or is nested
    too deep to skip: msgspec raises RecursionError skipping a 100k-deep field)."""
    try:
        return _decoder.decode(body).model
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def prefer_adapter(model: str | None, replicas: Sequence[ReplicaSnapshot]
                   ) -> list[ReplicaSnapshot]:
    serving = [r for r in replicas if r.lora is not None]
    if model is None or not serving or any(model in r.lora.base_models  # type: ignore[union-attr]
                                           for r in serving):
        return list(replicas)
    holders = [r for r in serving if model in r.lora.loaded]  # type: ignore[union-attr]
    if holders:  # only these can run it at all (others would answer 404)
        serving = holders
    active = [r for r in serving if model in r.lora.active]  # type: ignore[union-attr]
    roomy = [r for r in active if r.num_waiting == 0]
    if roomy:
        return roomy
    free = [r for r in serving if r.lora.has_free_slot]  # type: ignore[union-attr]
    return free or active or list(replicas)


def adapter_for_keys(model: str | None, infos: Iterable[LoraInfo | None]) -> str | None:
    """The adapter the engines hash this request's blocks with: its model name when some
    replica serves adapters and none names it as its base; None for the base, for a request
    with no model, and while no replica reports LoRA (all names are the base then)."""
    serving = [info for info in infos if info is not None]
    if model is None or not serving or any(model in info.base_models for info in serving):
        return None
    return model
