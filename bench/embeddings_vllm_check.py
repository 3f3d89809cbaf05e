"""Peer check: Shoal's /v1/embeddings, vLLM's pooling runner and transformers agree.

    .venv/bin/python bench/embeddings_vllm_check.py VLLM_VENV [--keep DIR]

Builds the checkpoint tests/api/test_embeddings.py serves (a tiny ``Qwen3Model`` laid out as
Qwen3-Embedding: no LM head, sentence-transformers LAST pooling + Normalize), embeds the same
token-id inputs with transformers (``last_hidden_state`` pooled), with vLLM's
``LLM(runner="pooling").embed`` (its own reading of modules.json) in the vLLM venv, and with
``shoal serve --runner pooling`` over HTTP, then prints the largest difference of each from
transformers. Exit 0 when both are within 1e-5.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["The quick brown fox", "jumps over the lazy dog, twice and once more", "x"]

VLLM_SIDE = r"""
import json, sys
from vllm import LLM, TokensPrompt
model, inputs = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model, runner="pooling", dtype="float32", enforce_eager=True, seed=0,
          max_model_len=512, max_num_seqs=8)
outs = llm.embed([TokensPrompt(prompt_token_ids=ids) for ids in inputs])
print("VECTORS " + json.dumps([o.outputs.embedding for o in outs]))
"""


def build_checkpoint(out: Path) -> None:
    from shoal.runtime.model.make_embedding_model import make_embedding_model
    from shoal.runtime.model.make_model import cached_model

    make_embedding_model(cached_model("qwen3", "tiny", seed=0), out)


def reference(model_dir: Path, inputs: list[list[int]]) -> np.ndarray:
    from transformers import Qwen3Model

    model = Qwen3Model.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for ids in inputs:
            last = model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1].double()
            rows.append((last / last.norm()).numpy())
    return np.stack(rows)


def shoal_vectors(model_dir: Path, inputs: list[list[int]]) -> np.ndarray:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "serve", "--model", str(model_dir),
                             "--runner", "pooling", "--host", "127.0.0.1", "--port", str(port),
                             "--served-model-name", "emb", "--num-kv-blocks", "256",
                             "--log-level", "warning"], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        response = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", timeout=60, json={
            "model": "emb", "input": inputs, "encoding_format": "float"})
        response.raise_for_status()
        return np.array([d["embedding"] for d in response.json()["data"]])
    finally:
        proc.terminate()
        proc.wait(30)


def main(vllm_venv: str, keep: str | None) -> int:
    from transformers import AutoTokenizer

    work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="emb-check-"))
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "config.json").is_file():
        build_checkpoint(work)
    tokenizer = AutoTokenizer.from_pretrained(work)
    inputs = [tokenizer(t)["input_ids"] for t in TEXTS]
    expected = reference(work, inputs)
    started = time.monotonic()
    result = subprocess.run([str(Path(vllm_venv) / "bin" / "python"), "-c", VLLM_SIDE,
                             str(work), json.dumps(inputs)], capture_output=True, text=True,
                            timeout=1500, cwd="/tmp",
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("VECTORS ")]
    if result.returncode != 0 or not lines:
        print(result.stderr[-4000:], file=sys.stderr)
        return 2
    vllm = np.array(json.loads(lines[-1][len("VECTORS "):]))
    print(f"vLLM embed: {time.monotonic() - started:.0f} s (start included)")
    shoal = shoal_vectors(work, inputs)
    vllm_err = float(np.abs(vllm - expected).max())
    shoal_err = float(np.abs(shoal - expected).max())
    print(f"max |vLLM - transformers|  = {vllm_err:.2e}")
    print(f"max |Shoal - transformers| = {shoal_err:.2e}")
    print(f"max |Shoal - vLLM|         = {float(np.abs(shoal - vllm).max()):.2e}")
    return 0 if max(vllm_err, shoal_err) < 1e-5 else 1


if __name__ == "__main__":
    args = sys.argv[1:]
    keep = args[args.index("--keep") + 1] if "--keep" in args else None
    if not args or args[0] == "--keep":
        sys.exit("usage: embeddings_vllm_check.py VLLM_VENV [--keep DIR] (a venv with vLLM's "
                 "CPU build)")
    sys.exit(main(args[0], keep))
