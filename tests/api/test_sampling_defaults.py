"""``--generation-config``: the checkpoint's generation_config.json sets the defaults of the
sampling fields a request leaves out, and a request's own field wins; ``/version``."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from shoal.runtime.api.sampling_defaults import default_of, load_sampling_defaults

from shoal import __version__

BODY = {"model": "shoal-test", "messages": [{"role": "user", "content": "Go on."}],
        "ignore_eos": True}


def test_only_the_fields_the_file_sets_become_defaults(tmp_path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True,
         "max_new_tokens": 512, "eos_token_id": [1, 2]}))
    defaults = load_sampling_defaults(str(tmp_path), "auto")
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 512}
    assert load_sampling_defaults(str(tmp_path), "none") == {}
    assert default_of(defaults, "temperature", None) == 0.6
    assert default_of(defaults, "temperature", 0.0) == 0.0  # the request wins, even at 0
    assert default_of({}, "top_p", None) == 1.0
    with pytest.raises(ValueError, match="no generation_config.json"):
        load_sampling_defaults(str(tmp_path), str(tmp_path / "elsewhere"))


@pytest.fixture(scope="module")
def server(start_server, tiny_qwen2, tmp_path_factory):
    """top_k 1 from the checkpoint makes an unspecified request greedy."""
    model = tmp_path_factory.mktemp("gen-config-qwen2")
    for path in tiny_qwen2.iterdir():
        shutil.copy(path, model / path.name)
    config = json.loads((tiny_qwen2 / "generation_config.json").read_text())
    config.update({"top_k": 1, "temperature": 0.9, "max_new_tokens": 7})
    (model / "generation_config.json").write_text(json.dumps(config))
    return start_server("--log-level", "info", model_dir=model)  # (the startup log line)


def chat(server, **fields) -> dict:
    response = httpx.post(server.v1 + "/chat/completions", json={**BODY, **fields}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_checkpoint_defaults_apply_and_request_fields_override(server) -> None:
    greedy = chat(server, temperature=0, max_tokens=20)["choices"][0]["message"]["content"]
    defaulted = chat(server, seed=1, max_tokens=20)  # top_k 1 from the checkpoint
    assert defaulted["choices"][0]["message"]["content"] == greedy
    sampled = [chat(server, seed=s, top_k=0, max_tokens=20)["choices"][0]["message"]["content"]
               for s in (1, 2)]
    assert any(text != greedy for text in sampled)  # top_k 0 sent: the default is gone
    assert chat(server)["usage"]["completion_tokens"] == 7  # max_new_tokens
    # the startup log says what applies (only the fields the file sets)
    line = next(x for x in server.log().splitlines() if "sampling defaults from" in x)
    assert line.endswith("max_tokens=7, temperature=0.9, top_k=1")


def test_version(server) -> None:
    assert server.get("/version").json() == {"version": __version__}
