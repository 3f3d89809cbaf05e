"""``--model ORG/NAME`` served from the local Hugging Face cache: the snapshot of the
requested revision (branch or commit), a clear refusal naming the id, revision and cache
when it is neither cached nor downloadable (no hub reachable in tests), and local paths
passed through untouched."""

from __future__ import annotations

import shutil

import pytest
from shoal.runtime.model_source import is_hub_id, resolve_model


@pytest.fixture
def hub_cache(tmp_path, tiny_model_dirs, monkeypatch):
    """A cache laid out as huggingface_hub writes it, holding tiny llama as
    ``shoal-test/tiny-llama`` at two commits: main and a tag ``v1``."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never reach out to a hub from a test
    repo = tmp_path / "hub" / "models--shoal-test--tiny-llama"
    commits = {"main": "a" * 40, "v1": "b" * 40}
    for ref, commit in commits.items():
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        shutil.copytree(tiny_model_dirs["llama"], repo / "snapshots" / commit)
    return tmp_path / "hub", commits


def test_a_hub_id_resolves_to_the_cached_snapshot_of_its_revision(hub_cache):
    cache, commits = hub_cache
    main = resolve_model("shoal-test/tiny-llama", None, cache_dir=cache)
    assert main.name == commits["main"] and (main / "config.json").is_file()
    tagged = resolve_model("shoal-test/tiny-llama", "v1", cache_dir=cache)
    assert tagged.name == commits["v1"]
    by_commit = resolve_model("shoal-test/tiny-llama", commits["v1"], cache_dir=cache)
    assert by_commit == tagged


def test_a_model_neither_cached_nor_downloadable_is_refused_by_name(hub_cache):
    cache, _ = hub_cache
    with pytest.raises(FileNotFoundError, match=r"'shoal-test/missing' \(revision main\) is "
                                                r"neither a local path nor in the Hugging Face"):
        resolve_model("shoal-test/missing", None, cache_dir=cache)
    with pytest.raises(FileNotFoundError, match=r"revision nope"):
        resolve_model("shoal-test/tiny-llama", "nope", cache_dir=cache)


def test_local_paths_are_not_hub_ids(tiny_model_dirs, tmp_path):
    local = tiny_model_dirs["llama"]
    assert not is_hub_id(str(local)) and resolve_model(str(local)) == local
    assert not is_hub_id("./org/name") and is_hub_id("Qwen/Qwen3-0.6B")
    with pytest.raises(ValueError, match="--revision 'v1' applies to a Hub id"):
        resolve_model(str(local), "v1")
