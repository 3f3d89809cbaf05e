"""Multi-LoRA over HTTP (``shoal serve --enable-lora``), checked against transformers + peft.

Three PEFT adapters made by peft on the tiny llama (ranks 8/4/16, different target sets, one
rsLoRA): two given at startup (``NAME=PATH`` and the JSON form), one loaded at run time.
Greedy completions for the base and every adapter, sent concurrently so they share steps,
with 2 adapter slots for 3 adapters, equal peft's greedy token for token (near-ties aside).
Then the errors: unknown adapter 404, bad adapters 400 naming why (the server keeps
serving), unload, and the LoRA metrics. Loading at run time is allowed explicitly
(SHOAL_ALLOW_RUNTIME_LORA_UPDATING, vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING) and always behind
the API key, on the main port and on --metrics-port; off, the endpoints are a 404."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .conftest import API_KEY, free_port

ALLOW = {"SHOAL_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": None}
DENY = {"SHOAL_ALLOW_RUNTIME_LORA_UPDATING": None, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def lora_server(start_server, tiny_llama, llama_adapters):
    json_form = json.dumps({"name": "all4", "path": str(llama_adapters["all4"]),
                            "base_model_name": "shoal-test"})
    metrics_port = free_port()
    server = start_server("--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2",
                          "--max-lora-rank", "16", "--max-num-seqs", "16",
                          "--metrics-port", str(metrics_port),
                          "--lora-modules", f"qv8={llama_adapters['qv8']}", json_form,
                          model_dir=tiny_llama, api_key=API_KEY, wait=False, env=ALLOW)
    server.wait_ready(timeout=240)  # parsing three adapters at startup, on a loaded machine
    server.metrics_port = metrics_port  # type: ignore[attr-defined]
    return server


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60, headers=server.headers())


def complete(server, model: str, prompt: list[int]) -> list[int]:
    response = post(server, "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == model
    return body["choices"][0]["token_ids"]


def test_adapters_and_base_mixed_over_http_equal_peft(lora_server, tiny_llama, llama_adapters,
                                                      hf_greedy):
    server = lora_server
    response = post(server, "/v1/load_lora_adapter",
                    {"lora_name": "mlp16", "lora_path": str(llama_adapters["mlp16"])})
    assert response.status_code == 200, response.text
    assert "added successfully" in response.text
    cards = {c["id"]: c for c in httpx.get(server.v1 + "/models",
                                           headers=server.headers()).json()["data"]}
    assert cards["shoal-test"]["parent"] is None
    for name, path in llama_adapters.items():
        assert cards[name]["parent"] == "shoal-test" and cards[name]["root"] == str(path)

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (3, 17, 33, 50)]
    jobs = [(model, i) for i in range(len(prompts))
            for model in ("shoal-test", "qv8", "all4", "mlp16")]
    with ThreadPoolExecutor(len(jobs)) as pool:  # all in flight at once: mixed steps
        results = list(pool.map(lambda job: complete(server, job[0], prompts[job[1]]), jobs))
    got = dict(zip(jobs, results, strict=True))
    for (model, i), tokens in got.items():
        reference = hf_greedy(tiny_llama, None if model == "shoal-test" else llama_adapters[model])
        assert reference.agrees(prompts[i], tokens), (model, i, tokens,
                                                      reference.generate(prompts[i], MAX_TOKENS))
    for name in llama_adapters:
        assert sum(got[(name, i)] != got[("shoal-test", i)] for i in range(4)) >= 2, name

    metrics = httpx.get(server.base_url + "/metrics", headers=server.headers()).text
    info = re.search(r'^shoal:lora_requests_info\{(.*)\} ([0-9.e+]+)$', metrics, re.M)
    assert info and 'max_lora="2"' in info.group(1) and float(info.group(2)) > 1e9
    for name in llama_adapters:
        assert re.search(rf'^shoal:lora_requests_total\{{.*lora_name="{name}".*\}} 4\.0$',
                         metrics, re.M), name
        assert f'shoal:lora_adapter_info{{lora_name="{name}"}} 1.0' in metrics, name


def test_lora_errors_are_404_and_400_and_the_server_keeps_serving(lora_server, llama_adapters,
                                                                  tmp_path):
    server = lora_server
    unknown = post(server, "/v1/completions", {"model": "nope", "prompt": [5, 6],
                                               "max_tokens": 2})
    assert unknown.status_code == 404
    (tmp_path / "empty").mkdir()
    for body, status, why in (
        ({"lora_name": "x", "lora_path": str(tmp_path / "empty")}, 400,
         "no adapter_config.json"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "absent")}, 400, "not a directory"),
        ({"lora_name": "qv8", "lora_path": str(llama_adapters["qv8"])}, 400,
         "already been loaded"),
        ({"lora_name": "x"}, 400, "lora_path"),
    ):
        response = post(server, "/v1/load_lora_adapter", body)
        assert response.status_code == status, response.text
        assert why in response.json()["error"]["message"], response.text
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "x"}).status_code == 404
    assert len(complete(server, "qv8", [5, 6, 7])) == MAX_TOKENS  # still serving

    temporary = post(server, "/v1/load_lora_adapter",
                     {"lora_name": "temp", "lora_path": str(llama_adapters["qv8"])})
    assert temporary.status_code == 200, temporary.text
    assert len(complete(server, "temp", [5, 6, 7])) == MAX_TOKENS
    unloaded = post(server, "/v1/unload_lora_adapter", {"lora_name": "temp"})
    assert unloaded.status_code == 200 and "removed successfully" in unloaded.text
    after = post(server, "/v1/completions", {"model": "temp", "prompt": [5], "max_tokens": 1})
    assert after.status_code == 404
    assert "temp" not in {c["id"] for c in httpx.get(server.v1 + "/models",
                                                     headers=server.headers()).json()["data"]}
    assert post(server, "/v1/load_lora_adapter", {}).status_code == 400
    no_key = httpx.post(server.base_url + "/v1/load_lora_adapter", timeout=10,
                        json={"lora_name": "k", "lora_path": str(llama_adapters["qv8"])})
    assert no_key.status_code == 401


def test_metrics_port_serves_the_adapter_endpoints_behind_the_key(lora_server, llama_adapters):
    """The operator's channel: /v1/models and load/unload on --metrics-port, with the same
    API key as the main port (401 without it), nothing else of /v1 there."""
    admin = f"http://127.0.0.1:{lora_server.metrics_port}"
    key = lora_server.headers()
    body = {"lora_name": "via-admin", "lora_path": str(llama_adapters["qv8"])}
    for path, sent in (("/v1/load_lora_adapter", body),
                       ("/v1/unload_lora_adapter", {"lora_name": "qv8"})):
        refused = httpx.post(admin + path, json=sent, timeout=10)
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.post(admin + path, json=sent, timeout=10,
                           headers={"Authorization": "Bearer not-the-key"})
        assert wrong.status_code == 401, wrong.text
    assert httpx.get(admin + "/v1/models", timeout=10).status_code == 401
    cards = httpx.get(admin + "/v1/models", timeout=10, headers=key).json()["data"]
    assert {"qv8", "all4"} <= {c["id"] for c in cards if c["parent"]}
    loaded = httpx.post(admin + "/v1/load_lora_adapter", timeout=60, json=body, headers=key)
    assert loaded.status_code == 200, loaded.text
    assert len(complete(lora_server, "via-admin", [5, 6, 7])) == MAX_TOKENS
    assert httpx.post(admin + "/v1/unload_lora_adapter", json={"lora_name": "via-admin"},
                      timeout=60, headers=key).status_code == 200
    assert httpx.post(admin + "/v1/completions", json={"prompt": "x"}, timeout=10,
                      headers=key).status_code == 404


def test_runtime_updating_not_allowed_is_a_404_behind_the_key(start_server, tiny_llama,
                                                              llama_adapters):
    """Without SHOAL_/VLLM_ALLOW_RUNTIME_LORA_UPDATING (here the vLLM one set to 0) adapters
    come from --lora-modules only: load and unload are refused on both ports (an OpenAI
    error naming the variable), after the API key is checked, and serving goes on."""
    metrics_port = free_port()
    server = start_server("--enable-lora", "--max-lora-rank", "16", "--max-num-seqs", "4",
                          "--metrics-port", str(metrics_port),
                          "--lora-modules", f"qv8={llama_adapters['qv8']}",
                          model_dir=tiny_llama, api_key=API_KEY, wait=False, env=DENY)
    server.wait_ready(timeout=240)
    load = {"lora_name": "new", "lora_path": str(llama_adapters["mlp16"])}
    for base in (server.base_url, f"http://127.0.0.1:{metrics_port}"):
        for path, body in (("/v1/load_lora_adapter", load),
                           ("/v1/unload_lora_adapter", {"lora_name": "qv8"})):
            assert httpx.post(base + path, json=body, timeout=10).status_code == 401
            refused = httpx.post(base + path, json=body, timeout=10, headers=server.headers())
            assert refused.status_code == 404, refused.text
            message = refused.json()["error"]["message"]
            assert "SHOAL_ALLOW_RUNTIME_LORA_UPDATING" in message, message
    cards = httpx.get(server.v1 + "/models", headers=server.headers()).json()["data"]
    assert {c["id"] for c in cards if c["parent"]} == {"qv8"}  # nothing loaded or unloaded
    assert len(complete(server, "qv8", [5, 6, 7])) == MAX_TOKENS


@pytest.mark.parametrize(("environ", "allowed"), [
    ({}, False),
    ({"SHOAL_ALLOW_RUNTIME_LORA_UPDATING": "1"}, True),
    ({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}, True),
    ({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": " 1 "}, True),
    ({"SHOAL_ALLOW_RUNTIME_LORA_UPDATING": "0", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": ""}, False),
    ({"SHOAL_ALLOW_RUNTIME_LORA_UPDATING": "yes"}, False),  # vLLM takes 1 and true only
])
def test_runtime_updating_is_allowed_by_either_variable(environ, allowed):
    from shoal.runtime.api.lora_adapters import runtime_updating_allowed

    assert runtime_updating_allowed(environ) is allowed
