"""MXFP4 gpt-oss checkpoints (the format published gpt-oss checkpoints ship their experts in)
are dequantized as they are loaded: the dequantization equals transformers' own, and greedy
output equals transformers' model dequantizing the same checkpoint (``Mxfp4Config(dequantize=
True)``, its CPU path), with prefix caching, chunked prefill and mixed lengths."""

from __future__ import annotations

import json

import pytest
import torch
from shoal.runtime.model.quant.mxfp4 import dequantize_mxfp4, dequantized_tensors
from shoal.runtime.model.quant.spec import QuantizationError

from tests.engine.test_hf_equivalence import check, engine, mixed_batch, run


def test_the_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 20, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 150, (3, 20, 4), dtype=torch.uint8, generator=gen)
    scales[0, 0, 0], scales[0, 0, 1] = 0, 254  # the exponent's ends: 2**-127 and 2**127
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(dequantize_mxfp4(blocks, scales), want)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16),
                       convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))


def test_a_half_without_its_partner_is_named():
    blocks = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)
    stream = iter([("model.layers.0.mlp.experts.down_proj_blocks", blocks),
                   ("model.norm.weight", torch.ones(4))])
    with pytest.raises(ValueError, match="down_proj_blocks without its scales"):
        list(dequantized_tensors(stream))


@pytest.fixture(scope="module")
def mxfp4_dirs(tiny_moe_model_dirs, tmp_path_factory):
    """The checkpoint as published (for the engine), and a view of it whose config asks
    transformers to dequantize (its only way on a CPU without its Triton kernels)."""
    from shoal.runtime.model.quant_makers.mxfp4 import make_mxfp4_gpt_oss

    served = make_mxfp4_gpt_oss(tiny_moe_model_dirs["gpt_oss"],
                                tmp_path_factory.mktemp("gpt-oss-mxfp4"))
    reference = tmp_path_factory.mktemp("gpt-oss-mxfp4-hf")
    for path in served.iterdir():
        (reference / path.name).symlink_to(path)
    config = json.loads((served / "config.json").read_text())
    config["quantization_config"]["dequantize"] = True
    (reference / "config.json").unlink()
    (reference / "config.json").write_text(json.dumps(config))
    return served, reference


def test_an_mxfp4_gpt_oss_checkpoint_equals_hf_dequantizing_it(mxfp4_dirs, hf_greedy,
                                                               assert_matches_hf):
    served, reference = mxfp4_dirs
    arrivals = mixed_batch(1)
    core = engine(served, max_num_batched_tokens=32, block_size=8)
    assert core.model_config.quantization.method == "mxfp4"
    outputs = run(core, arrivals)
    assert check(hf_greedy(reference), assert_matches_hf, arrivals, outputs) <= 1


def test_mxfp4_on_another_architecture_is_refused_naming_it(tiny_moe_model_dirs, tmp_path):
    source = tiny_moe_model_dirs["qwen3_moe"]
    for path in source.iterdir():
        (tmp_path / path.name).symlink_to(path)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match="gpt-oss experts only, not for "
                                                "Qwen3MoeForCausalLM"):
        engine(tmp_path)


def test_the_served_experts_are_the_dequantized_ones(mxfp4_dirs):
    """Not the full-precision weights the checkpoint was made from: the engine's experts
    equal transformers' dequantized parameters (de-interleaved as the engine stores them)."""
    from transformers import AutoModelForCausalLM

    served, reference = mxfp4_dirs
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    ours = engine(served).executor.worker.runner.model.model.layers[0].mlp.experts
    theirs = hf.model.layers[0].mlp.experts
    gate_up = theirs.gate_up_proj.detach()  # [E, H, 2I], gate and up interleaved
    assert torch.equal(ours.gate_up_proj[:, :ours.local], gate_up[..., 0::2].transpose(1, 2))
    assert torch.equal(ours.down_proj, theirs.down_proj.detach().transpose(1, 2))
