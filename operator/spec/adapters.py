"""spec.adapters: LoRA adapters served beside the model (parsing, engine flags, volumes).

The sync on running engines is loop/engine_calls.py.

``spec.adapters: [{name, source}]`` (source: ``pvc://claim/path`` or an absolute path in the
image; ``hf://`` is refused for now: engine pods do not download after start), with
``spec.lora.maxLoras`` / ``maxLoraRank``. The engines run with ``--enable-lora`` and those
limits; the adapter list is not in the pod template, so adding or removing one never rolls
the pods. Each round the operator asks every ready replica which adapters it serves
(``/v1/models`` on its metrics port) and loads or unloads the difference through vLLM's
endpoints (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``), in the same round and
before the replica's readiness gate opens, so a new replica receives traffic only once it
serves the declared adapters. Unloading lets running requests finish (the engine's rule).
Adapter claims are mounted read-only at ``/mnt/adapters/<claim>``.

Loading at run time needs the engine's permission (``SHOAL_ALLOW_RUNTIME_LORA_UPDATING=1``,
rendered only then) and its API key, which the operator never holds (it reads no Secrets).
So with ``spec.auth`` the adapters are given at startup instead (``--lora-modules``): adding
or removing one changes the pod template and rolls the pods (a rolling update, requests are
drained, not dropped), and each replica's ``status`` lists the adapters its pod was started
with. Without ``spec.auth`` the engines have no key and the operator loads and unloads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from shoal.operator.spec.model_uri import ModelSource, ModelUriError, parse_model_uri
from shoal.operator.spec.reader import SpecError

ADAPTER_MOUNT = "/mnt/adapters"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,126}$")
DEFAULT_MAX_LORAS = 4
RUNTIME_UPDATING_ENV = "SHOAL_ALLOW_RUNTIME_LORA_UPDATING"  # runtime/api/lora_adapters.py


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    uri: str
    source: ModelSource

    @property
    def engine_path(self) -> str:
        """Where the engine reads the adapter's files."""
        if self.source.scheme == "pvc":
            return f"{ADAPTER_MOUNT}/{self.source.claim}/{self.source.path}".rstrip("/")
        return self.source.path


@dataclass(frozen=True)
class LoraSpec:
    adapters: tuple[AdapterSpec, ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16


def parse_adapters(data: Any, lora: dict[str, Any] | None, served_name: str) -> LoraSpec | None:
    """spec.adapters and spec.lora; None when neither is given (LoRA off)."""
    if data is None and lora is None:
        return None
    if data is None:
        data = []
    if not isinstance(data, list):
        raise SpecError("spec.adapters", "must be a list of {name, source}")
    adapters: list[AdapterSpec] = []
    for i, item in enumerate(data):
        at = f"spec.adapters[{i}]"
        if not isinstance(item, dict):
            raise SpecError(at, "must be an object {name, source}")
        name, uri = item.get("name"), item.get("source")
        if not isinstance(name, str) or not _NAME.match(name):
            raise SpecError(f"{at}.name", "must be 1-127 letters, digits, '.', '_' or '-'")
        if name == served_name:
            raise SpecError(f"{at}.name", "must differ from the model's served name")
        if any(a.name == name for a in adapters):
            raise SpecError(f"{at}.name", f"{name!r} is declared twice")
        if not isinstance(uri, str):
            raise SpecError(f"{at}.source", "is required")
        try:
            source = parse_model_uri(uri)
        except ModelUriError as exc:
            raise SpecError(f"{at}.source", str(exc).replace("model.uri", "source")) from exc
        if source.scheme not in ("pvc", "path"):
            raise SpecError(f"{at}.source", "must be pvc://claim/path or an absolute path in "
                            "the image (hf:// adapters are not supported yet)")
        adapters.append(AdapterSpec(name, uri, source))
    lora = lora or {}
    # not derived from the list: the flags are in the pod template, the list is not
    max_loras = lora.get("maxLoras", DEFAULT_MAX_LORAS)
    max_rank = lora.get("maxLoraRank", 16)
    for key, value in (("maxLoras", max_loras), ("maxLoraRank", max_rank)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecError(f"spec.lora.{key}", "must be an integer >= 1")
    return LoraSpec(tuple(adapters), max_loras, max_rank)


def syncs_at_run_time(lora: LoraSpec | None, engines_need_a_key: bool) -> bool:
    """Whether the operator loads and unloads adapters in running engines (no engine key:
    it has none to send) rather than giving them at startup."""
    return lora is not None and not engines_need_a_key


def lora_engine_args(lora: LoraSpec | None, engines_need_a_key: bool) -> list[str]:
    if lora is None:
        return []
    args = ["--enable-lora", "--max-loras", str(lora.max_loras),
            "--max-lora-rank", str(lora.max_lora_rank)]
    if not syncs_at_run_time(lora, engines_need_a_key) and lora.adapters:
        args += ["--lora-modules", *(f"{a.name}={a.engine_path}" for a in lora.adapters)]
    return args


def lora_engine_env(lora: LoraSpec | None, engines_need_a_key: bool) -> list[dict[str, str]]:
    """The engine's permission to load at run time, only where the operator does so."""
    if not syncs_at_run_time(lora, engines_need_a_key):
        return []
    return [{"name": RUNTIME_UPDATING_ENV, "value": "1"}]


def adapters_in_args(args: list[str]) -> tuple[str, ...]:
    """The adapter names a pod was started with (``--lora-modules NAME=PATH ...``)."""
    names: list[str] = []
    if "--lora-modules" in args:
        for value in args[args.index("--lora-modules") + 1:]:
            if value.startswith("--"):
                break
            names.append(value.split("=", 1)[0])
    return tuple(sorted(names))


def adapter_volumes(lora: LoraSpec | None, model_claim: str | None
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Read-only volumes and mounts for the adapters' claims (each once)."""
    claims = sorted({a.source.claim for a in (lora.adapters if lora else ())
                     if a.source.scheme == "pvc"})
    volumes, mounts = [], []
    for i, claim in enumerate(claims):
        volumes.append({"name": f"adapters-{i}", "persistentVolumeClaim": {
            "claimName": claim, "readOnly": True}})
        mounts.append({"name": f"adapters-{i}", "mountPath": f"{ADAPTER_MOUNT}/{claim}",
                       "readOnly": True})
    del model_claim  # a claim shared with the model is simply mounted twice, read-only
    return volumes, mounts
