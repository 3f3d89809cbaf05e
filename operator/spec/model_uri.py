"""Where an engine finds its weights: hf://org/name[@rev], pvc://claim/path, builtin://default or
an absolute path inside the image."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Hugging Face repo ids: org and name of letters, digits, '-', '_', '.'; revision a branch/tag/sha.
_HF = re.compile(r"^hf://(?P<org>[A-Za-z0-9][\w.-]*)/(?P<name>[A-Za-z0-9][\w.-]*)(@(?P<rev>[\w./-]+))?$")
_PVC = re.compile(r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9]*[a-z0-9])?)(/(?P<path>.*))?$")

# The same accepted forms as one pattern: the CRD schema uses it verbatim (tests check they agree).
URI_PATTERN = (
    r"^(hf://[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?"
    r"|builtin://default"
    r"|/.+)$"
)


class ModelUriError(ValueError):
    pass


@dataclass(frozen=True)
class ModelSource:
    scheme: str  # hf | pvc | builtin | path
    repo: str = ""  # hf: org/name
    revision: str = ""  # hf: branch, tag or commit ("" = main)
    claim: str = ""  # pvc: claim name
    path: str = ""  # pvc: path inside the claim; path: absolute path in the image

    @property
    def default_served_name(self) -> str:
        if self.scheme == "hf":
            return self.repo
        if self.scheme == "builtin":
            return "shoal-demo"
        tail = self.path.rstrip("/").rsplit("/", 1)[-1]
        return tail or self.claim

    @property
    def cache_dir_name(self) -> str:
        """Folder under the weight cache for an hf:// model; one per (repo, revision)."""
        return f"{self.repo.replace('/', '--')}--{self.revision or 'main'}"


def parse_model_uri(uri: str) -> ModelSource:
    if not isinstance(uri, str) or not uri:
        raise ModelUriError("model.uri is required")
    if uri.startswith("hf://"):
        match = _HF.match(uri)
        if not match:
            raise ModelUriError(f"model.uri {uri!r}: expected hf://org/name[@revision]")
        repo = f"{match['org']}/{match['name']}"
        return ModelSource("hf", repo=repo, revision=match["rev"] or "")
    if uri.startswith("pvc://"):
        match = _PVC.match(uri)
        if not match:
            raise ModelUriError(f"model.uri {uri!r}: expected pvc://claim-name/path")
        return ModelSource("pvc", claim=match["claim"], path=match["path"] or "")
    if uri == "builtin://default":
        return ModelSource("builtin")
    if uri.startswith("/"):
        return ModelSource("path", path=uri)
    raise ModelUriError(
        f"model.uri {uri!r}: expected hf://org/name[@revision], pvc://claim/path, "
        "builtin://default or an absolute path in the image"
    )
