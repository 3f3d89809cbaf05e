"""The LoRA admission gate: at most ``max_loras`` distinct adapters run at once.

The worker computes a step with one slot per distinct adapter, and it has ``--max-loras``
of them; so a waiting request whose adapter is not running while every slot is taken waits
(it is never failed). Requests behind it that fit (the base model, or an adapter already
running) are admitted past it, as vLLM's scheduler does. Base-model requests always fit.
"""

from __future__ import annotations

from collections.abc import Iterable

from shoal.runtime.scheduler.request import Request


class LoraGate:
    def __init__(self, max_loras: int, running: Iterable[Request]) -> None:
        self.max_loras = max_loras
        self.active = {r.lora_name for r in running if r.lora_name is not None}

    def fits(self, req: Request) -> bool:
        name = req.lora_name
        return name is None or name in self.active or len(self.active) < self.max_loras

    def first_fitting(self, waiting: Iterable[Request]) -> Request | None:
        """The first waiting request (in queue order) that may start now."""
        return next((r for r in waiting if self.fits(r)), None)

    def admitted(self, req: Request) -> None:
        if req.lora_name is not None:
            self.active.add(req.lora_name)


def adapters_of(requests: Iterable[Request]) -> list[str]:
    """The distinct adapters of ``requests``, sorted (for the lora_requests_info labels)."""
    return sorted({r.lora_name for r in requests if r.lora_name is not None})
