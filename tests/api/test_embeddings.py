"""``/v1/embeddings`` with ``--runner pooling``, equal to transformers' own hidden states.

The checkpoint is what Qwen3-Embedding ships: transformers' ``Qwen3Model`` saved as is (no LM
head, tensor names without ``model.``), a sentence-transformers ``modules.json`` asking for
last-token pooling and a Normalize module, and ``is_matryoshka``. The reference is
``Qwen3Model``'s ``last_hidden_state`` for each input alone, pooled as the checkpoint says.
Served through the official openai client (base64 by default, float on request)."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

TEXTS = ["The quick brown fox", "jumps over the lazy dog, twice and once more", "x"]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def embedding_model(tiny_qwen3: Path, tmp_path_factory) -> Path:
    from shoal.runtime.model.make_embedding_model import make_embedding_model

    return make_embedding_model(tiny_qwen3, tmp_path_factory.mktemp("qwen3-embedding"),
                                matryoshka=True)


@pytest.fixture(scope="module")
def reference(embedding_model: Path):
    """token ids -> transformers' last_hidden_state [T, hidden] for that input alone."""
    from transformers import Qwen3Model

    model = Qwen3Model.from_pretrained(embedding_model, dtype=torch.float32).eval()

    def hidden(token_ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([token_ids])).last_hidden_state[0]
        return out.double().numpy()

    return hidden


@pytest.fixture(scope="module")
def tokenize(embedding_model: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedding_model)
    return lambda text: tok(text)["input_ids"]


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


@pytest.fixture(scope="module")
def last_server(start_server, embedding_model):
    # a small step budget: the longer inputs are prefilled in several chunks
    return start_server("--runner", "pooling", "--max-num-batched-tokens", "8",
                        model_dir=embedding_model)


@pytest.fixture(scope="module")
def client(last_server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=last_server.v1, api_key="unused", max_retries=0)


def test_openai_client_base64_batch_equals_hf_last_token_normalized(client, reference,
                                                                     tokenize) -> None:
    got = client.embeddings.create(model="shoal-test", input=TEXTS)  # base64 by default
    assert [d.index for d in got.data] == [0, 1, 2]
    for text, item in zip(TEXTS, got.data, strict=True):
        expected = unit(reference(tokenize(text))[-1])
        assert np.abs(np.array(item.embedding) - expected).max() < TOLERANCE
    assert got.usage.prompt_tokens == sum(len(tokenize(t)) for t in TEXTS)
    assert got.usage.total_tokens == got.usage.prompt_tokens


def test_float_format_token_ids_and_dimensions(client, reference, tokenize) -> None:
    ids = tokenize(TEXTS[1])
    as_float = client.embeddings.create(model="shoal-test", input=ids, encoding_format="float")
    expected = unit(reference(ids)[-1])
    assert len(as_float.data) == 1
    assert np.abs(np.array(as_float.data[0].embedding) - expected).max() < TOLERANCE
    nested = client.embeddings.create(model="shoal-test", input=[ids, tokenize("x")],
                                      encoding_format="float")
    assert np.abs(np.array(nested.data[0].embedding) - expected).max() < TOLERANCE
    cut = client.embeddings.create(model="shoal-test", input=ids, dimensions=8)
    vector = np.array(cut.data[0].embedding)
    assert vector.shape == (8,)
    assert np.abs(vector - unit(reference(ids)[-1][:8])).max() < TOLERANCE


def test_bad_inputs_and_generation_on_a_pooling_model_are_400(last_server) -> None:
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(last_server.v1 + path, json={"model": "shoal-test", **body},
                          timeout=30)

    for body, param in (({"input": []}, "input"), ({"input": ""}, "input"),
                        ({"input": "a", "dimensions": 0}, "dimensions"),
                        ({"input": "a", "dimensions": 10**6}, "dimensions"),
                        ({"input": "a", "encoding_format": "bytes"}, None)):
        response = post("/embeddings", body)
        assert response.status_code == 400, (body, response.text)
        if param:
            assert response.json()["error"]["param"] == param
    chat = post("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "--runner pooling" in chat.json()["error"]["message"]
    assert post("/embeddings", {"model": "other", "input": "a"}).status_code == 404


def test_mean_pooling_override_unnormalized_and_chunked(start_server, embedding_model,
                                                        reference, tokenize) -> None:
    server = start_server("--runner", "pooling", "--max-num-batched-tokens", "8",
                          "--pooler-config", '{"pooling_type": "MEAN", "use_activation": false}',
                          model_dir=embedding_model)
    response = httpx.post(server.v1 + "/embeddings", timeout=60, json={
        "model": "shoal-test", "input": TEXTS, "encoding_format": "float"})
    assert response.status_code == 200, response.text
    for text, item in zip(TEXTS, response.json()["data"], strict=True):
        expected = reference(tokenize(text)).mean(axis=0)
        assert np.abs(np.array(item["embedding"]) - expected).max() < TOLERANCE
    server.stop()


def test_a_chat_model_asked_for_embeddings_is_a_400(tiny_chat_server) -> None:
    response = httpx.post(tiny_chat_server.v1 + "/embeddings", timeout=30,
                          json={"model": "shoal-test", "input": "hello"})
    assert response.status_code == 400
    assert "--runner pooling" in response.json()["error"]["message"]


def test_dimensions_only_where_the_checkpoint_allows_them() -> None:
    """Without is_matryoshka a request may not cut the vector (vLLM's 400); with
    matryoshka_dimensions only those lengths; else any length up to the hidden size."""
    from shoal.runtime.api.errors import APIError
    from shoal.runtime.api.serving_embeddings import check_dimensions
    from shoal.runtime.pooling_config import PoolerConfig

    plain = PoolerConfig(hidden_size=64)
    listed = PoolerConfig(matryoshka=True, matryoshka_dimensions=(16, 32), hidden_size=64)
    free = PoolerConfig(matryoshka=True, hidden_size=64)
    check_dimensions(None, plain, "m")
    check_dimensions(32, listed, "m")
    check_dimensions(64, free, "m")
    for dimensions, pooler, message in ((8, plain, "does not support matryoshka"),
                                        (24, listed, "only supports dimensions [16, 32]"),
                                        (65, free, "dimensions must be in [1, 64]")):
        with pytest.raises(APIError) as refused:
            check_dimensions(dimensions, pooler, "m")
        assert message in refused.value.message and refused.value.status == 400
        assert refused.value.param == "dimensions"
