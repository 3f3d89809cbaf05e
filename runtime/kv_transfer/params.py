"""What a request and an engine say about moving KV between engines (vLLM's shapes).

``KVTransferParams`` is vLLM's per-request ``kv_transfer_params``: a P/D proxy sends the
prefill engine ``do_remote_decode`` (compute the prompt, keep its blocks for a remote decode)
with ``max_tokens=1``, takes the ``kv_transfer_params`` of its response (``do_remote_prefill``
and where the blocks wait: ``remote_engine_id``, ``remote_host``, ``remote_port``,
``remote_request_id``, ``remote_block_ids``) and sends them with the original request to the
decode engine, which pulls the blocks instead of computing them. ``KVTransferConfig`` is
vLLM's ``--kv-transfer-config`` (``kv_connector``, ``kv_role``, ``engine_id``, ``kv_ip``,
``kv_port``, ``kv_connector_extra_config``), checked when it is parsed.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
from shoal.runtime.json_flag import json_object_flag

CONNECTORS = ("TcpConnector",)
ROLES = ("kv_producer", "kv_consumer", "kv_both")
# vLLM's NIXL connector keeps a finished prefill's blocks 480 s (VLLM_NIXL_ABORT_REQUEST_TIMEOUT)
DEFAULT_ABORT_REQUEST_TIMEOUT_S = 480.0
DEFAULT_TRANSFER_TIMEOUT_S = 30.0  # one pull, connect to last byte; past it: compute instead


class KVTransferParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    do_remote_decode: bool = False  # a prefill: keep the prompt's blocks for a remote decode
    do_remote_prefill: bool = False  # a decode: the prompt's blocks wait on a remote engine
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_block_ids: list[int] | None = None
    tp_size: int = 1

    def to_json(self) -> dict[str, Any]:
        """The response's ``kv_transfer_params``, every field present as vLLM writes them."""
        return {f: getattr(self, f) for f in self.__struct_fields__}

    @property
    def pullable(self) -> bool:
        return (self.do_remote_prefill and bool(self.remote_host)
                and self.remote_port is not None and bool(self.remote_request_id))


def parse_request_params(raw: dict[str, Any] | None) -> KVTransferParams | None:
    """A request body's ``kv_transfer_params`` (ValueError naming what is wrong). Unknown keys
    are kept out, not refused: proxies add their own (vLLM's connectors each read theirs)."""
    if raw is None:
        return None
    known = {k: v for k, v in raw.items() if k in KVTransferParams.__struct_fields__}
    try:
        params = msgspec.convert(known, KVTransferParams)
    except msgspec.ValidationError as exc:
        raise ValueError(f"kv_transfer_params: {exc}") from None
    if params.do_remote_decode and params.do_remote_prefill:
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill are "
                         "exclusive")
    if params.remote_port is not None and not 0 < params.remote_port < 65536:
        raise ValueError(f"kv_transfer_params: remote_port {params.remote_port} is not a port")
    if not (params.do_remote_decode or params.do_remote_prefill):
        return None  # nothing to do: an ordinary request
    return params


@dataclass
class KVTransferConfig:
    kv_connector: str = "TcpConnector"
    kv_role: str = "kv_both"
    engine_id: str = ""  # empty: a fresh uuid per engine
    kv_ip: str = "127.0.0.1"  # where this engine serves its blocks (what remote_host says)
    kv_port: int = 0  # 0: a free port, reported in every response's remote_port
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"--kv-transfer-config: kv_connector {self.kv_connector!r} is not "
                             f"served here ({', '.join(CONNECTORS)})")
        if self.kv_role not in ROLES:
            raise ValueError(f"--kv-transfer-config: kv_role {self.kv_role!r} is not one of "
                             f"{', '.join(ROLES)}")
        if not 0 <= self.kv_port < 65536:
            raise ValueError(f"--kv-transfer-config: kv_port {self.kv_port} is not a port")
        for name in ("abort_request_timeout", "transfer_timeout"):
            value = self.kv_connector_extra_config.get(name)
            if value is not None and (not isinstance(value, int | float) or value <= 0):
                raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.{name} "
                                 f"must be a positive number of seconds, got {value!r}")
        if not self.engine_id:
            self.engine_id = uuid.uuid4().hex

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def abort_request_timeout(self) -> float:
        return float(self.kv_connector_extra_config.get("abort_request_timeout",
                                                        DEFAULT_ABORT_REQUEST_TIMEOUT_S))

    @property
    def transfer_timeout(self) -> float:
        return float(self.kv_connector_extra_config.get("transfer_timeout",
                                                        DEFAULT_TRANSFER_TIMEOUT_S))


def parse_transfer_config(text: str) -> KVTransferConfig:
    """``--kv-transfer-config`` JSON (ValueError naming the flag and what is wrong)."""
    raw = json_object_flag("--kv-transfer-config", text, KVTransferConfig.__dataclass_fields__)
    try:
        return KVTransferConfig(**raw)
    except TypeError as exc:  # a value of the wrong type
        raise ValueError(f"--kv-transfer-config: {exc}") from None
