"""Root fixtures shared by every test area: model checkpoints built once per machine.

``cached_model`` builds into ``$SHOAL_CACHE_DIR/models`` (default ``~/.cache/shoal``) the
first time and reuses it afterwards, so these fixtures cost seconds only on a fresh machine.
tiny models (< 1M parameters) are for unit tests; ``small_qwen3`` for integration tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .hf_reference import HFGreedy


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch in the test process on one thread for a module (restored after): test models
    gain little from threads, and on a shared 2-core machine OpenMP barriers stall for whole
    scheduler slices (a 135M model's chat answers took 10x longer on two threads beside other
    jobs). Autouse in the engine and serving areas; kernel tests keep the threads they test."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(arch: str, size: str) -> Path:
    from shoal.runtime.model.make_model import cached_model

    return cached_model(arch, size, seed=0)


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    """Llama with llama3 rope scaling and a single KV head (TP=2 replicates it)."""
    return _model("llama", "tiny")


@pytest.fixture(scope="session")
def tiny_qwen2() -> Path:
    """Qwen2: qkv bias, tied embeddings, 2 KV heads."""
    return _model("qwen2", "tiny")


@pytest.fixture(scope="session")
def tiny_qwen3() -> Path:
    """Qwen3: q/k RMSNorm, head_dim (32) independent of hidden/heads (16)."""
    return _model("qwen3", "tiny")


@pytest.fixture(scope="session")
def small_qwen3() -> Path:
    """Qwen3 with ~5.6M parameters: the integration-test model (random weights)."""
    return _model("qwen3", "small")


@pytest.fixture(scope="session")
def tiny_model_dirs(tiny_llama: Path, tiny_qwen2: Path, tiny_qwen3: Path) -> dict[str, Path]:
    """arch name -> tiny checkpoint dir, for tests parametrised over every architecture."""
    return {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3}


@pytest.fixture(scope="session")
def tiny_moe_model_dirs() -> dict[str, Path]:
    """Mixture-of-experts tiny checkpoints: qwen3_moe (renormalised top-k), qwen2_moe (gated
    shared expert, a dense layer), mixtral (block_sparse_moe names), glm4_moe, gpt_oss
    (attention sinks, alternating sliding layers, yarn; see make_moe_model.py)."""
    from shoal.runtime.model.make_moe_model import MOE_ARCHS, cached_moe_model

    return {arch: cached_moe_model(arch, "tiny") for arch in MOE_ARCHS}


# -- LoRA: PEFT adapters made by peft itself, and peft as the reference ---------------------

@pytest.fixture(scope="session")
def make_lora_adapter(tmp_path_factory):
    """make_lora_adapter(base_dir, name, rank, alpha, targets, use_rslora=False, seed=0,
    gain=1.0) -> the adapter folder peft's ``save_pretrained`` wrote (adapter_config.json +
    adapter_model.safetensors). Both A and B are random (``init_lora_weights=False``), B
    multiplied by ``gain`` so the adapter moves greedy output visibly."""
    made: dict[tuple, Path] = {}

    def make(base_dir: Path, name: str, rank: int, alpha: float, targets: list[str],
             use_rslora: bool = False, seed: int = 0, gain: float = 1.0) -> Path:
        key = (str(base_dir), name, rank, alpha, tuple(targets), use_rslora, seed, gain)
        if key not in made:
            import torch
            from peft import LoraConfig, get_peft_model
            from transformers import AutoModelForCausalLM

            torch.manual_seed(seed)
            base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
            config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                use_rslora=use_rslora, init_lora_weights=False,
                                lora_dropout=0.0)
            model = get_peft_model(base, config)
            with torch.no_grad():
                for param_name, param in model.named_parameters():
                    if "lora_B" in param_name:
                        param.mul_(gain)
            out = tmp_path_factory.mktemp(f"lora-{name}")
            model.save_pretrained(out)
            made[key] = out
        return made[key]

    return make


@pytest.fixture(scope="session")
def llama_adapters(tiny_llama, make_lora_adapter) -> dict[str, Path]:
    """Three adapters on the tiny llama, for the engine, offline and HTTP LoRA tests: ranks
    8/4/16, different target sets and alpha, one rsLoRA."""
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return {
        "qv8": make_lora_adapter(tiny_llama, "qv8", 8, 16, ["q_proj", "v_proj"], seed=1,
                                 gain=4.0),
        "all4": make_lora_adapter(tiny_llama, "all4", 4, 8, every, use_rslora=True, seed=2,
                                  gain=3.0),
        "mlp16": make_lora_adapter(tiny_llama, "mlp16", 16, 32,
                                   ["o_proj", "gate_proj", "down_proj"], seed=3, gain=2.0),
    }


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(model_dir, adapter_dir=None) -> HFGreedy (tests/hf_reference.py), one per
    checkpoint and adapter for the whole session."""
    made: dict[tuple[str, str | None], HFGreedy] = {}

    def get(model_dir: Path, adapter_dir: Path | None = None) -> HFGreedy:
        key = (str(model_dir), None if adapter_dir is None else str(adapter_dir))
        if key not in made:
            made[key] = HFGreedy(model_dir, adapter_dir)
        return made[key]

    return get

