"""GGUF checkpoints against transformers' own GGUF loading (the reference): config, tokenizer
ids, dequantized weights, and greedy output of the engine on the file; refusals by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from .gguf_files import assert_greedy_equals_hf, hf_from_gguf, write_gguf

pytest.importorskip("gguf")

TEXTS = ["Hello world, what is the capital of France?", "  two  spaces\nand a newline\t tab",
         "numbers 1234567 and ünïcödé — dashes", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory, tiny_llama: Path, tiny_qwen2: Path,
               tiny_qwen3: Path) -> dict[str, Path]:
    """llama: Q8_0 + one Q4_1, with add_bos; qwen2: Q4_0 + F16; f32-*: in F32, where
    dequantization is exact, so it must give back the safetensors weights. (transformers
    cannot load a qwen3 GGUF whose head_dim is not hidden/heads, as the tiny one's: it ignores
    attention.key_length, so qwen3 is checked by the F32 round trip only.)"""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for name, model, arch, quant, types, bos in [
            ("llama", tiny_llama, "llama", "Q8_0", {"blk.0.ffn_up.weight": "Q4_1"}, True),
            ("qwen2", tiny_qwen2, "qwen2", "Q4_0", {"blk.1.attn_v.weight": "F16"}, False),
            ("f32-llama", tiny_llama, "llama", "F32", None, False),
            ("f32-qwen2", tiny_qwen2, "qwen2", "F32", None, False),
            ("f32-qwen3", tiny_qwen3, "qwen3", "F32", None, False)]:
        folder = root / name
        folder.mkdir()
        out[name] = write_gguf(model, folder / f"{name}.gguf", arch, quant, bos, types)
    return out


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_weights_and_config_equal_transformers_loading(gguf_files, name: str) -> None:
    from shoal.runtime.model.config import load_model_config
    from shoal.runtime.model.gguf_checkpoint import GGUFCheckpoint

    path = gguf_files[name]
    reference, _ = hf_from_gguf(path)
    expected = reference.state_dict()
    tensors = GGUFCheckpoint(path).tensors()
    assert {t.hf_name for t in tensors} == {k for k in expected
                                            if not (k == "lm_head.weight"
                                                    and reference.config.tie_word_embeddings)}
    for tensor in tensors:
        assert torch.equal(tensor.dequantize(), expected[tensor.hf_name]), tensor.hf_name
    config = load_model_config(path)
    ref = reference.config
    assert (config.vocab_size, config.hidden_size, config.num_layers, config.num_heads,
            config.num_kv_heads, config.head_dim, config.intermediate_size) == (
        ref.vocab_size, ref.hidden_size, ref.num_hidden_layers, ref.num_attention_heads,
        ref.num_key_value_heads,
        getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads,
        ref.intermediate_size)
    assert config.tie_word_embeddings == ref.tie_word_embeddings
    assert config.hf_config.rope_parameters == ref.rope_parameters
    assert config.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert config.eos_token_ids == [ref.eos_token_id]


def test_the_file_reads_as_the_gguf_packages_reader_reads_it(gguf_files) -> None:
    """``GGUFFile`` against ``gguf.GGUFReader``: every metadata value (type included) and
    every tensor's name, type, dimensions and data view (dtype, shape, bytes)."""
    from gguf import GGUFReader
    from shoal.runtime.model.gguf_checkpoint import GGUFFile

    for path in gguf_files.values():
        want, ours = GGUFReader(str(path)), GGUFFile(path)
        fields = {k: f.contents() for k, f in want.fields.items() if not k.startswith("GGUF.")}
        assert fields == ours.fields
        assert [type(v) for v in fields.values()] == [type(v) for v in ours.fields.values()]
        assert len(want.tensors) == len(ours.tensors)
        for a, b in zip(want.tensors, ours.tensors, strict=True):
            assert (a.name, a.tensor_type, tuple(a.shape.tolist())) == (
                b.name, b.tensor_type, b.dims)
            assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
            assert np.array_equal(a.data, b.data), a.name


def test_raw_blocks_stay_reachable(gguf_files) -> None:
    """The quantized blocks are there as stored, for a loader that keeps them quantized."""
    from shoal.runtime.model.gguf_checkpoint import GGUFCheckpoint

    by_name = {t.hf_name: t for t in GGUFCheckpoint(gguf_files["llama"]).tensors()}
    q = by_name["model.layers.0.self_attn.q_proj.weight"]
    assert q.ggml_type == "Q8_0" and q.blocks.dtype.name == "uint8"
    assert q.shape == (64, 64) and q.blocks.shape == (64, 64 // 32 * 34)  # 34-byte blocks
    assert by_name["model.layers.0.mlp.up_proj.weight"].ggml_type == "Q4_1"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_file_gives_back_the_checkpoint(gguf_files, tiny_model_dirs, arch: str) -> None:
    """Exact values: the names map right and llama's q/k permutation is undone."""
    from safetensors.torch import load_file
    from shoal.runtime.model.config import load_model_config
    from shoal.runtime.model.gguf_checkpoint import GGUFCheckpoint

    model_dir = tiny_model_dirs[arch]
    original = load_file(str(next(model_dir.glob("*.safetensors"))))
    tensors = GGUFCheckpoint(gguf_files[f"f32-{arch}"]).tensors()
    assert {t.hf_name for t in tensors} == set(original)
    for tensor in tensors:
        assert torch.equal(tensor.dequantize(), original[tensor.hf_name].float()), tensor.hf_name
    from_gguf = load_model_config(gguf_files[f"f32-{arch}"])
    from_dir = load_model_config(model_dir)
    for key in ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "intermediate_size", "tie_word_embeddings",
                "qkv_bias", "qk_norm", "hidden_act"):
        assert getattr(from_gguf, key) == getattr(from_dir, key), key
    # GGUF stores these as float32
    assert from_gguf.rms_norm_eps == pytest.approx(from_dir.rms_norm_eps, rel=1e-6)
    theta = from_dir.hf_config.rope_parameters["rope_theta"]
    assert from_gguf.hf_config.rope_parameters["rope_theta"] == pytest.approx(theta, rel=1e-6)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_token_ids_and_chat_template_equal_transformers(gguf_files, name: str) -> None:
    from shoal.runtime.frontend.tokenizer import Tokenizer

    path = gguf_files[name]
    _, reference = hf_from_gguf(path)
    for source in (path, path.parent):  # the file, or the directory holding it
        tokenizer = Tokenizer.from_dir(source)
        for text in TEXTS:
            assert tokenizer.backend.encode(text).ids == reference(text).input_ids, text
        assert tokenizer.chat_template == reference.chat_template
        assert tokenizer.eos_token == reference.eos_token
    if name == "llama":  # the file says add_bos_token: both put BOS first
        assert reference(TEXTS[0]).input_ids[0] == reference.bos_token_id


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_the_grammar_vocabulary_equals_xgrammars_reading_of_transformers_tokenizer(
        gguf_files, name: str) -> None:
    """Structured output on a GGUF file: the grammar backend's vocabulary (from
    ``gguf_hf_tokenizer``) is what xgrammar reads from transformers' own tokenizer of it."""
    xgr = pytest.importorskip("xgrammar")
    from shoal.runtime.model.config import load_model_config
    from shoal.runtime.structured.backend import GrammarBackend

    path = gguf_files[name]
    _, reference = hf_from_gguf(path)
    config = load_model_config(path)
    backend = GrammarBackend(str(path), config.vocab_size, config.eos_token_ids)
    assert backend.prepare()
    ours = backend._get_tokenizer_info()
    want = xgr.TokenizerInfo.from_huggingface(reference, vocab_size=config.vocab_size,
                                              stop_token_ids=config.eos_token_ids)
    assert ours.dump_metadata() == want.dump_metadata()
    assert ours.decoded_vocab == want.decoded_vocab


def _native() -> bool:
    from shoal.kernels.native_cpu import unavailable_reason

    return unavailable_reason() is None


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_blocks_kept_quantized_equal_the_gguf_dequantization(gguf_files, name: str) -> None:
    """Q4_0/Q4_1/Q8_0 in the int kernel's layout (llama's q/k rows un-permuted) give back the
    gguf package's dequantized values exactly; other types are not taken."""
    if not _native():
        pytest.skip("the native library does not build here")
    from shoal.runtime.model.gguf_checkpoint import GGUFCheckpoint
    from shoal.runtime.model.quant.gguf_int import KERNEL_TYPES, gguf_packed

    from shoal.kernels.int_matmul_cpu import dequantize

    seen = set()
    for tensor in GGUFCheckpoint(gguf_files[name]).tensors():
        packed = gguf_packed(tensor)
        if tensor.ggml_type not in KERNEL_TYPES:
            assert packed is None, tensor.gguf_name
            continue
        assert packed is not None
        seen.add(tensor.ggml_type)
        assert torch.equal(dequantize(packed), tensor.dequantize()), tensor.gguf_name
    assert seen == ({"Q8_0", "Q4_1"} if name == "llama" else {"Q4_0"})


# layers left dense: a fused layer with a part the kernel does not take (an F16 v beside Q4_0
# q and k); llama's Q8_0 gate with a Q4_1 up stays quantized, part by part
DENSE_LAYERS: dict[str, set[str]] = {"llama": set(),
                                     "qwen2": {"model.layers.1.self_attn.qkv_proj"}}


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_engine_greedy_equals_transformers_on_the_file(gguf_files, name: str) -> None:
    """The served path on a GGUF (config, tokenizer, weights from the file, kept in their
    blocks on CPU) matches HF's GGUF loading, which dequantizes, token for token (float32)."""
    from shoal.runtime.llm import LLM
    from shoal.runtime.model.linear import _Linear

    path = gguf_files[name]
    reference, tokenizer = hf_from_gguf(path)
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=64)
    if _native():
        model = llm.engine.executor.worker.runner.model  # type: ignore[attr-defined]
        dense = {n for n, m in model.named_modules()
                 if isinstance(m, _Linear) and not hasattr(m, "int_packed_codes")}
        assert dense == DENSE_LAYERS[name]
        # the vocabulary table too (Q8_0 / Q4_0 here): its rows equal transformers' values
        embed, head = model.model.embed_tokens, model.lm_head
        assert embed.int_packed_codes.dtype == torch.uint8 and embed.weight.is_meta
        assert head.quant is not None and head.int_packed_codes.dtype == torch.uint8
        ids = torch.tensor([[0, 5, 17], [63, 2, 2]])
        with torch.no_grad():
            assert torch.equal(embed(ids), reference.model.embed_tokens.weight[ids])
    assert_greedy_equals_hf(llm, reference, tokenizer)


def test_unsupported_architecture_and_tensor_type_are_refused_by_name(
        tmp_path, tiny_qwen2: Path, tiny_llama: Path) -> None:
    from shoal.runtime.model.config import load_model_config

    phi = write_gguf(tiny_qwen2, tmp_path / "phi.gguf", "phi2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi2'"):
        load_model_config(phi)
    iq = write_gguf(tiny_llama, tmp_path / "iq.gguf", "llama",
                    tensor_types={"blk.0.ffn_down.weight": "Q8_1"})
    with pytest.raises(ValueError, match="blk.0.ffn_down.weight has unsupported GGUF "
                                         "tensor type Q8_1"):
        load_model_config(iq)
    (tmp_path / "two").mkdir()
    for copy in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / copy).write_bytes(iq.read_bytes())
    with pytest.raises(ValueError, match="several GGUF files"):
        load_model_config(tmp_path / "two")
