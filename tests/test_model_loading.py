"""`model.pretrained`: a local directory, and hub names read from a hub cache with a revision, offline."""

import inspect
import shutil
import socket

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from lightning_lazytrain.node_load import init_context
from lightning_lazytrain.sft.model_loading import build_model
from lightning_lazytrain.sft.module import CausalLMModule

TINY = dict(
    model_type="qwen2",
    vocab_size=512,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)
REPO = "someone/tiny-qwen"


def _weights(model):
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def _saved(path, seed):
    torch.manual_seed(seed)
    model = build_model(model_config=TINY)
    model.save_pretrained(path)
    return _weights(model)


def _hub_cache(tmp_path, revisions):
    """A hub cache as huggingface_hub lays it out: refs/<name> holds a commit, snapshots/<commit> its files."""
    repo = tmp_path / "cache" / f"models--{REPO.replace('/', '--')}"
    weights = {}
    for i, ref in enumerate(revisions):
        commit = f"{i + 1:040x}"
        weights[ref] = _saved(repo / "snapshots" / commit, seed=i)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return tmp_path / "cache", weights


def test_local_directory_saved_with_save_pretrained(tmp_path):
    want = _saved(tmp_path / "local", seed=3)
    module = CausalLMModule(pretrained=str(tmp_path / "local"), max_generate_samples=0)
    got = _weights(module.model)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert module.model.dtype == torch.float32  # dtype "auto" keeps what was saved


def test_hub_name_from_a_cache_dir_at_a_revision(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache, weights = _hub_cache(tmp_path, ["main", "v1"])
    assert not torch.equal(weights["main"]["lm_head.weight"], weights["v1"]["lm_head.weight"])
    for revision, ref in [(None, "main"), ("v1", "v1")]:
        module = CausalLMModule(
            pretrained=REPO, revision=revision, cache_dir=str(cache), local_files_only=True, max_generate_samples=0
        )
        got = _weights(module.model)
        assert all(torch.equal(got[k], weights[ref][k]) for k in weights[ref]), ref


def test_local_files_only_never_reaches_the_network(tmp_path, monkeypatch):
    """from_pretrained's adapter lookup ignored local_files_only: offline, it waited out the hub's retries."""

    def refuse(*args, **kwargs):
        raise AssertionError("local_files_only reached the network")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    cache, weights = _hub_cache(tmp_path, ["main"])
    got = _weights(build_model(REPO, cache_dir=str(cache), local_files_only=True))
    assert all(torch.equal(got[k], weights["main"][k]) for k in weights["main"])


def test_local_files_only_refuses_a_name_not_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache, _ = _hub_cache(tmp_path, ["main"])
    where = r"model.pretrained 'someone/other' \(revision main, hub cache .*, local files only\)"
    with pytest.raises(OSError, match=where):
        build_model("someone/other", cache_dir=str(cache), local_files_only=True)
    shutil.rmtree(cache)
    with pytest.raises(OSError, match=REPO):
        build_model(REPO, cache_dir=str(cache), local_files_only=True)


def test_remote_code_is_off_unless_asked(tmp_path, monkeypatch):
    assert inspect.signature(CausalLMModule).parameters["trust_remote_code"].default is False
    seen = {}
    real = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    _saved(tmp_path / "local", seed=0)
    CausalLMModule(pretrained=str(tmp_path / "local"), max_generate_samples=0).configure_model()
    assert seen["trust_remote_code"] is False and seen["local_files_only"] is True


def test_empty_context_builds_the_saved_model_on_meta_without_reading_weights(tmp_path, monkeypatch):
    """A machine's other ranks: the same architecture, dtype and generation config as from_pretrained, no weights."""
    _saved(tmp_path / "local", seed=3)
    GenerationConfig(max_new_tokens=7, repetition_penalty=1.3).save_pretrained(tmp_path / "local")
    full = CausalLMModule(pretrained=str(tmp_path / "local"), dtype="bfloat16").model
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", None)  # it must not be called
    with init_context(empty=True):
        module = CausalLMModule(pretrained=str(tmp_path / "local"), dtype="bfloat16")
        module.configure_model()
    empty = module.model
    assert {p.device.type for p in empty.parameters()} == {"meta"}
    assert empty.dtype == full.dtype == torch.bfloat16
    assert list(empty.state_dict()) == list(full.state_dict())
    assert {n: p.shape for n, p in empty.state_dict().items()} == {n: p.shape for n, p in full.state_dict().items()}
    assert empty.generation_config.repetition_penalty == full.generation_config.repetition_penalty == 1.3
    with init_context(empty=True):
        random_init = CausalLMModule(model_config=TINY).model
    assert {p.device.type for p in random_init.parameters()} == {"meta"}


def test_from_pretrained_in_the_empty_context_names_the_fix(tmp_path):
    _saved(tmp_path / "local", seed=0)
    with pytest.raises(RuntimeError, match="lightning_lazytrain.node_load.load_pretrained"), init_context(empty=True):
        AutoModelForCausalLM.from_pretrained(tmp_path / "local")
