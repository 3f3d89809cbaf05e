"""Multi-head latent attention (DeepSeek-V3): the latent cache's size, the absorbed decode
against plain expanded attention, the backend choice, the softmax scale under DeepSeek's
yarn, and multi-token-prediction layers skipped with a log line."""

from __future__ import annotations

import logging
import math
import shutil

import pytest
import torch
from shoal.runtime.attention.backend import AttentionMetadata
from shoal.runtime.attention.backend_choice import choose_attention_backend
from shoal.runtime.attention.mla_torch import mla_attention
from shoal.runtime.attention.torch_backend import TorchAttentionBackend
from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.core import EngineCore
from shoal.runtime.model.config import load_model_config
from shoal.runtime.model.make_mla_model import cached_mla_model, mla_hf_config
from shoal.runtime.model.mla_config import softmax_scale
from shoal.runtime.worker.worker import Worker


def _worker(model_dir, **kwargs) -> Worker:
    worker = Worker(EngineConfig.from_kwargs(str(model_dir), dtype="float32", device="cpu",
                                             **kwargs))
    worker.load_model()
    return worker


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v3_plain_q"])
def test_the_cache_holds_the_latent_and_the_rotary_key_per_token_and_layer(arch):
    """num_layers * (kv_lora_rank + qk_rope_head_dim) * element size, not expanded K/V; the
    engine sizes its blocks from that, and /metrics' num_gpu_blocks is that count."""
    model_dir = cached_mla_model(arch)
    hf = mla_hf_config(arch)
    mc = load_model_config(model_dir)
    per_token = hf.num_hidden_layers * (hf.kv_lora_rank + hf.qk_rope_head_dim) * 4
    assert mc.kv_bytes_per_token(torch.float32) == per_token
    assert mc.kv_bytes_per_token(torch.float32, tp_size=2) == per_token  # replicated
    assert mc.kv_bytes_per_token(torch.bfloat16) == per_token // 2
    expanded = hf.num_hidden_layers * hf.num_attention_heads * (
        hf.qk_nope_head_dim + hf.qk_rope_head_dim + hf.v_head_dim) * 4
    assert per_token < expanded / 2  # what caching expanded K/V would cost

    budget = 1_000_000
    core = EngineCore(EngineConfig.from_kwargs(str(model_dir), dtype="float32", device="cpu",
                                               block_size=16, kv_cache_memory=budget,
                                               max_model_len=128))
    assert core.executor.kv_bytes_per_block() == 16 * per_token
    assert core.scheduler.kv.num_blocks == budget // (16 * per_token)
    layer_caches = core.executor.worker.runner.kv_caches  # type: ignore[attr-defined]
    assert len(layer_caches) == hf.num_hidden_layers
    blocks = core.scheduler.kv.num_blocks
    latent, rope_key = layer_caches[0]
    assert latent.shape == (blocks, 16, 1, hf.kv_lora_rank)
    assert rope_key.shape == (blocks, 16, 1, hf.qk_rope_head_dim)
    held = sum(t.numel() * t.element_size() for pair in layer_caches for t in pair)
    assert held == blocks * 16 * per_token


def _expanded_reference(q_nope, q_pe, latents, k_pe, kv_b, scale):
    """Plain causal attention over keys/values expanded from every latent (float64)."""
    nope = q_nope.shape[-1]
    kv = torch.einsum("sl,hdl->shd", latents, kv_b)
    heads = q_nope.shape[1]
    keys = torch.cat((kv[..., :nope], k_pe[:, None].expand(-1, heads, -1)), -1)
    queries = torch.cat((q_nope, q_pe), -1)
    scores = torch.einsum("thd,shd->hts", queries, keys) * scale
    length = latents.shape[0]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, kv[..., nope:])


def test_absorbed_decode_and_chunked_expanded_prefill_equal_plain_attention():
    """One sequence of 23 tokens run as a prefill of 9, a chunk of 6 over that cached prefix,
    then 8 single-token decodes, beside a second sequence decoding in the same steps; every
    output equals attention over expanded keys and values. Unused cache slots hold NaN."""
    torch.manual_seed(0)
    heads, nope, rope, v_dim, rank, bs = 3, 8, 4, 6, 10, 4
    total = 23
    kv_b = torch.randn(heads, nope + v_dim, rank, dtype=torch.float64)
    seqs = [dict(q_nope=torch.randn(total, heads, nope, dtype=torch.float64),
                 q_pe=torch.randn(total, heads, rope, dtype=torch.float64),
                 latent=torch.randn(total, rank, dtype=torch.float64),
                 k_pe=torch.randn(total, rope, dtype=torch.float64)) for _ in range(2)]
    latent_cache = torch.full((16, bs, 1, rank), float("nan"), dtype=torch.float64)
    rope_cache = torch.full((16, bs, 1, rope), float("nan"), dtype=torch.float64)
    tables = torch.tensor([[5, 2, 9, 0, 14, 7], [1, 3, 4, 6, 8, 10]], dtype=torch.int32)
    backend, scale = TorchAttentionBackend(), 0.3
    steps = [[(0, 0, 9)], [(0, 9, 15), (1, 0, 1)]]  # (seq, start, end) of each row
    steps += [[(0, t, t + 1), (1, t - 14, t - 13)] for t in range(15, total)]
    for rows in steps:
        starts, pieces = [0], []
        for seq, lo, hi in rows:
            starts.append(starts[-1] + hi - lo)
            pieces.append({k: v[lo:hi] for k, v in seqs[seq].items()})
        flat = {k: torch.cat([p[k] for p in pieces]) for k in pieces[0]}
        slots = torch.cat([tables[seq].long()[torch.arange(lo, hi) // bs] * bs
                           + torch.arange(lo, hi) % bs for seq, lo, hi in rows])
        seq_lens = [hi for _, _, hi in rows]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables[[seq for seq, _, _ in rows]], slot_mapping=slots,
            max_query_len=max(hi - lo for _, lo, hi in rows), max_seq_len=max(seq_lens),
            block_size=bs, query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)
        out = mla_attention(backend, flat["q_nope"], flat["q_pe"], flat["latent"],
                            flat["k_pe"], latent_cache, rope_cache,
                            backend.build_metadata(meta), kv_b, scale)
        for i, (seq, lo, hi) in enumerate(rows):
            s = seqs[seq]
            want = _expanded_reference(s["q_nope"][:hi], s["q_pe"][:hi], s["latent"][:hi],
                                       s["k_pe"][:hi], kv_b, scale)[lo:hi]
            torch.testing.assert_close(out[starts[i]:starts[i + 1]], want)


def test_auto_takes_the_torch_backend_and_an_explicit_other_one_is_refused_naming_it(caplog):
    needs = frozenset({"latent_attention"})
    with caplog.at_level(logging.WARNING):
        assert choose_attention_backend("auto", "cpu", False, False, cpu_kernel=None,
                                        needs=needs) == "torch"
    assert "latent_attention" in caplog.text
    assert choose_attention_backend("auto", "cuda", False, True, needs=needs) == "torch"
    with pytest.raises(ValueError, match="does not implement latent_attention"):
        choose_attention_backend("cpu", "cpu", False, False, cpu_kernel=None, needs=needs)
    with pytest.raises(ValueError, match="does not implement latent_attention"):
        choose_attention_backend("triton", "cuda", False, True, needs=needs)
    assert load_model_config(cached_mla_model("deepseek_v3")).attention_features == needs


def test_the_softmax_scale_folds_deepseek_yarns_mscale_as_transformers_does():
    from transformers.modeling_rope_utils import yarn_apply_mscale

    params = mla_hf_config("deepseek_v3").rope_parameters
    assert softmax_scale(24, params) == pytest.approx(yarn_apply_mscale(params, 24 ** -0.5))
    m = 0.1 * 0.8 * math.log(4.0) + 1.0
    assert softmax_scale(24, params) == pytest.approx(24 ** -0.5 * m * m)
    assert softmax_scale(24, {"rope_type": "default", "rope_theta": 1e4}) == 24 ** -0.5
    mc = load_model_config(cached_mla_model("deepseek_v3"))
    assert mc.mla is not None and mc.mla.scale == pytest.approx(24 ** -0.5 * m * m)
    assert mc.ropes["default"].interleaved and mc.ropes["default"].rotary_dim == 8


def test_multi_token_prediction_layers_are_skipped_with_a_log_line(tmp_path, caplog):
    """DeepSeek-V3 checkpoints store their MTP module as layer ``num_hidden_layers``; its
    tensors are not loaded (and not refused), and the log says MTP is not used."""
    import json

    from safetensors.torch import save_file

    model_dir = tmp_path / "with_mtp"
    shutil.copytree(cached_mla_model("deepseek_v3"), model_dir)
    save_file({"model.layers.3.eh_proj.weight": torch.zeros(64, 128),
               "model.layers.3.self_attn.kv_b_proj.weight": torch.zeros(160, 32)},
              str(model_dir / "mtp.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1  # transformers' default
    with caplog.at_level(logging.INFO, logger="shoal.runtime.model.loader"):
        _worker(model_dir)
    assert "multi-token-prediction" in caplog.text and "2 of their tensors skipped" in caplog.text
    config["num_nextn_predict_layers"] = 0  # then a layer past the decoder is an error
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model.layers.3"):
        _worker(model_dir)


def test_the_engine_logs_its_cache_in_latent_bytes_per_token(caplog):
    hf = mla_hf_config("deepseek_v3")
    per_token = hf.num_hidden_layers * (hf.kv_lora_rank + hf.qk_rope_head_dim) * 4
    with caplog.at_level(logging.INFO, logger="shoal.engine.core"):
        EngineCore(EngineConfig.from_kwargs(str(cached_mla_model("deepseek_v3")),
                                            dtype="float32", device="cpu", block_size=4,
                                            num_kv_blocks=20, max_model_len=64))
    assert (f"KV cache: 20 blocks of 4 tokens, {per_token} bytes per token per rank (latent + "
            "rotary key") in caplog.text


def test_a_bfloat16_model_keeps_the_router_in_float32_and_serves(hf_bf16_first_tokens):
    """As transformers keeps ``gate.weight`` and the correction bias in float32 for DeepSeek
    (``_keep_in_fp32_modules_strict``): the router's weight is the checkpoint's float32 values
    unrounded. The bfloat16 model (latent cache in bfloat16) serves, and its first greedy
    token equals HF bfloat16's wherever HF's own top-2 margin is clear of bfloat16 noise."""
    from safetensors import safe_open

    model_dir = cached_mla_model("deepseek_v3")
    core = EngineCore(EngineConfig.from_kwargs(str(model_dir), dtype="bfloat16", device="cpu",
                                               max_model_len=128, num_kv_blocks=64))
    model = core.executor.worker.runner.model  # type: ignore[attr-defined]
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.float32
    assert gate.e_score_correction_bias.dtype == torch.float32
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert torch.equal(gate.weight, f.get_tensor("model.layers.1.mlp.gate.weight"))
    assert core.executor.worker.runner.kv_caches[0][0].dtype == torch.bfloat16  # type: ignore

    from shoal.runtime.sampling_params import SamplingParams
    from shoal.runtime.wire.messages import EngineCoreRequest

    prompts = {f"r{i}": [(37 * i + 11 * j) % 1000 + 3 for j in range(5 + 9 * i)]
               for i in range(6)}
    for req_id, prompt in prompts.items():
        core.add_request(EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt,
                                           sampling_params=SamplingParams(temperature=0.0,
                                                                          max_tokens=1)))
    first: dict[str, int] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            first.setdefault(out.request_id, out.new_token_ids[0])
    compared = 0
    for req_id, prompt in prompts.items():
        token, margin = hf_bf16_first_tokens(model_dir, prompt)
        if margin > 0.1:  # a few bfloat16 ulps of logits of size ~10
            assert first[req_id] == token, req_id
            compared += 1
    assert compared >= 3


@pytest.fixture(scope="module")
def hf_bf16_first_tokens():
    models: dict[str, object] = {}

    def first(model_dir, prompt: list[int]) -> tuple[int, float]:
        from transformers import AutoModelForCausalLM

        key = str(model_dir)
        if key not in models:
            models[key] = AutoModelForCausalLM.from_pretrained(model_dir,
                                                               dtype=torch.bfloat16).eval()
        with torch.inference_mode():
            logits = models[key](torch.tensor([prompt])).logits[0, -1].float()  # type: ignore
        top = logits.topk(2)
        return int(top.indices[0]), float(top.values[0] - top.values[1])

    return first
