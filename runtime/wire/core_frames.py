"""Frames between the API process and the engine-core process, besides ``messages.py``.

API -> core (PUSH -> PULL): ``[RequestType byte, msgpack payload]``: ADD carries an
``EngineCoreRequest``, ABORT a list of request ids, UTILITY a ``UtilityCall``.
Heartbeats use their own PAIR socket, answered by a thread in the core process, so a step
that takes seconds (a big prefill on CPU) does not look like a hang, while a stopped
process or a loop stuck in one step does.
core -> API (PUSH -> PULL): ``[CoreMessageType byte, msgpack payload]``. Light on purpose: the
API process imports this module and ``messages.py`` only, never torch or the engine.
"""

from __future__ import annotations

import enum

import msgspec


class CoreMessageType(bytes, enum.Enum):
    OUTPUTS = b"\x00"  # EngineCoreOutputs
    UTILITY_REPLY = b"\x01"  # UtilityReply
    STARTUP = b"\x02"  # StartupPhase
    REQUEST_ERROR = b"\x03"  # RequestError: the core rejected one request
    FATAL = b"\x04"  # FatalError: the core is exiting


STARTUP_PHASES = ("loading", "profiling", "capturing", "ready")


class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    method: str  # "heartbeat" | "reset_prefix_cache" | "check_invariants" | "shutdown"
    # | "add_lora" [name, path] | "remove_lora" [name]
    args: list[str] = msgspec.field(default_factory=list)


class Heartbeat(msgspec.Struct, array_like=True):
    """Answered by the core's heartbeat thread, even in the middle of a long step."""

    call_id: int
    # how long the loop's current step has gone without using CPU (0 between steps):
    # a long step that computes is slow, one that does not is stuck
    step_stalled_s: float = 0.0


class UtilityReply(msgspec.Struct, array_like=True):
    call_id: int
    ok: bool
    result: str = ""


class StartupPhase(msgspec.Struct, kw_only=True, array_like=True):
    phase: str  # the phase that starts now; "ready" when done
    durations: dict[str, float]  # seconds taken by each finished phase
    max_model_len: int = 0  # set with "ready"
    num_kv_blocks: int = 0
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    vocab_size: int = 0
    quantization: str = ""  # the checkpoint's quantization method ("": full precision)
    # KV cache groups (kv/kv_groups.py): a short request takes a block in each per block of
    # its tokens, so admission counts num_kv_blocks / kv_cache_groups blocks of tokens
    kv_cache_groups: int = 1


class RequestError(msgspec.Struct, array_like=True):
    request_id: str
    param: str
    message: str
    internal: bool = False  # failed in the engine (not the client's input): a 500


class FatalError(msgspec.Struct, array_like=True):
    message: str
