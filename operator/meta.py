"""Metadata every child carries: names, labels, selector and the owner reference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shoal.operator.constants import (
    API_VERSION,
    COMPONENT_ENGINE,
    KIND,
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_SERVICE,
    MANAGER,
)


@dataclass(frozen=True)
class Owner:
    """The InferenceService a child belongs to (from the object's metadata)."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Owner:
        meta = body.get("metadata") or {}
        return cls(name=meta["name"], namespace=meta.get("namespace") or "default",
                   uid=meta.get("uid") or "")


def engine_name(owner: Owner) -> str:
    return f"{owner.name}-engine"


def router_name(owner: Owner) -> str:
    return f"{owner.name}-router"


def prefill_name(owner: Owner) -> str:
    return f"{owner.name}-prefill"


def epp_name(owner: Owner) -> str:
    return f"{owner.name}-epp"


def cache_claim_name(owner: Owner) -> str:
    return f"{owner.name}-model-cache"


def selector_labels(owner: Owner, component: str) -> dict[str, str]:
    return {LABEL_SERVICE: owner.name, LABEL_COMPONENT: component}


def engine_selector(owner: Owner) -> dict[str, str]:
    return selector_labels(owner, COMPONENT_ENGINE)


def label_selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def child_metadata(owner: Owner, name: str, component: str) -> dict[str, Any]:
    labels = {**selector_labels(owner, component), LABEL_MANAGED_BY: MANAGER}
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels,
        "ownerReferences": [owner_reference(owner)],
    }


def owner_reference(owner: Owner) -> dict[str, Any]:
    # controller=True: one controller per child; blockOwnerDeletion: foreground deletion waits.
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
