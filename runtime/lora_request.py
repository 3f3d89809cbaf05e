"""``LoRARequest``: the offline API's way to run a prompt on an adapter (vLLM's shape).

``LLM.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/path/to/adapter"))``
(one for every prompt, or a list with one per prompt, ``None`` for the base). The adapter is
loaded the first time a request names it and stays loaded; it is identified by its name,
which is also its identity in the prefix cache, as in the server (``model: "<name>"``).
vLLM keys adapters by ``lora_int_id``; here a name and its id must stay paired, so a second
request that reuses a name with another id or path is refused rather than silently served
by the first adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest: lora_name must not be empty")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest: lora_int_id must be an integer >= 1, got "
                             f"{self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path must name the "
                             "adapter's folder (adapter_config.json + adapter_model.safetensors)")


def per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
               num_prompts: int) -> list[LoRARequest | None]:
    """One adapter (or None: the base) for each prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    requests = list(lora_request)
    if len(requests) != num_prompts:
        raise ValueError(f"{len(requests)} lora requests for {num_prompts} prompts")
    for request in requests:
        if request is not None and not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request entries must be LoRARequest or None, got "
                            f"{type(request).__name__}")
    return requests


def check_pairing(known: dict[str, LoRARequest], request: LoRARequest) -> bool:
    """Whether ``request``'s adapter is already loaded (True) or new (False); a name reused
    with another id or path, or an id reused under another name, is a ValueError."""
    previous = known.get(request.lora_name)
    if previous is not None:
        if (previous.lora_int_id, previous.lora_path) != (request.lora_int_id,
                                                          request.lora_path):
            raise ValueError(f"LoRA adapter {request.lora_name!r} is already loaded as id "
                             f"{previous.lora_int_id} from {previous.lora_path!r}; give "
                             "another name for another adapter")
        return True
    for other in known.values():
        if other.lora_int_id == request.lora_int_id:
            raise ValueError(f"lora_int_id {request.lora_int_id} is already adapter "
                             f"{other.lora_name!r}")
    return False
