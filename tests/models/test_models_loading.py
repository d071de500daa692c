"""Loading HuggingFace directories: each bad input gives one error naming the file and the problem; nothing is half-loaded."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from headwise.convert import load_checked
from headwise.models import GPT2LMHeadModel


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(directory: Path, **changes: object) -> None:
    file = directory / "config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))


def test_wrong_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=f"{re.escape(str(missing))}: no such directory"):
        GPT2LMHeadModel.from_pretrained(missing)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(NotADirectoryError, match=r"file.txt: not a directory"):
        GPT2LMHeadModel.from_pretrained(tmp_path / "file.txt")
    with pytest.raises(TypeError, match=r"path must be a str or os.PathLike naming a HuggingFace model directory, got int"):
        GPT2LMHeadModel.from_pretrained(3)


def test_directory_without_weights_or_config(gpt2_dir, tmp_path):
    d = copy_of(gpt2_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"m: no weights found \(expected model.safetensors, model.safetensors.index.json or pytorch_model.bin\)"):
        GPT2LMHeadModel.from_pretrained(d)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config.json: file not found"):
        GPT2LMHeadModel.from_pretrained(d)


def test_sharded_checkpoint_with_a_broken_index_is_named(gpt2_dir, tmp_path):
    d = copy_of(gpt2_dir, tmp_path / "m")
    (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
    (d / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: expected a 'weight_map' object"):
        GPT2LMHeadModel.from_pretrained(d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"transformer.wte.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match=r"index.json: names shard files that are not in .*: \['model-00002-of-00002.safetensors'\]"):
        GPT2LMHeadModel.from_pretrained(d)
    from safetensors.torch import load_file

    held = sorted(load_file(d / "model-00001-of-00001.safetensors"))
    wrong = {key: "model-00001-of-00001.safetensors" for key in held[1:]} | {held[0]: "model-00002-of-00002.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wrong}))  # one key sent to a shard not there: the
    with pytest.raises(FileNotFoundError, match=r"names shard files that are not in"):  # index named, not the shard that holds it
        GPT2LMHeadModel.from_pretrained(d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.bias": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(ValueError, match=r"model-00001-of-00001.safetensors: lacks tensors the index puts there: \['lm_head.bias'\]"):
        GPT2LMHeadModel.from_pretrained(d)
    listed = {key: "model-00001-of-00001.safetensors" for key in held[1:]}  # the index leaves one out: not dropped silently
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": listed}))
    with pytest.raises(ValueError, match=rf"model-00001-of-00001.safetensors: holds tensors the index does not list: \['{re.escape(held[0])}'\]"):
        GPT2LMHeadModel.from_pretrained(d)
    (d / "pytorch_model.bin.index.json").write_text("{}")
    (d / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match=r"pytorch_model.bin.index.json: sharded .bin checkpoints are not supported"):
        GPT2LMHeadModel.from_pretrained(d)


def test_config_that_is_not_json_or_not_gpt2(gpt2_dir, tmp_path):
    d = copy_of(gpt2_dir, tmp_path / "m")
    (d / "config.json").write_text('{"n_embd": 64,')
    with pytest.raises(ValueError, match=r"config.json: not valid JSON"):
        GPT2LMHeadModel.from_pretrained(d)
    (d / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match=r"config.json: describes model_type 'bert', expected 'gpt2'"):
        GPT2LMHeadModel.from_pretrained(d)


def test_config_this_gpt2_cannot_run(gpt2_dir, tmp_path):
    d = copy_of(gpt2_dir, tmp_path / "m")
    edit_config(d, activation_function="relu", scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(ValueError, match=r"config.json: unsupported GPT-2 settings: activation_function='relu' .*; scale_attn_by_inverse_layer_idx=True"):
        GPT2LMHeadModel.from_pretrained(d)
    edit_config(d, activation_function="gelu_new", scale_attn_by_inverse_layer_idx=False, n_head=5)
    with pytest.raises(ValueError, match=r"config.json: invalid GPT-2 config: n_embd \(64\) must be divisible by n_head \(5\)"):
        GPT2LMHeadModel.from_pretrained(d)


def test_config_that_disagrees_with_the_tensors(gpt2_dir, tmp_path):
    d = copy_of(gpt2_dir, tmp_path / "m")
    edit_config(d, n_layer=3, n_positions=64)
    with pytest.raises(ValueError, match=r"model.safetensors; nothing was loaded") as err:
        GPT2LMHeadModel.from_pretrained(d)
    message = str(err.value)
    assert "missing: transformer.h.2.attn.c_attn.weight" in message  # every problem listed at once
    assert "wrong shape: transformer.wpe.weight: expected (64, 64), got (48, 64)" in message


def test_unknown_and_missing_keys_are_listed_together(gpt2_dir, tmp_path):
    d = copy_of(gpt2_dir, tmp_path / "m")
    state = load_file(d / "model.safetensors")
    del state["transformer.ln_f.bias"]
    state["transformer.h.0.attn.rotary.weight"] = torch.zeros(3)
    save_file(state, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"(?s)cannot load .*model.safetensors; nothing was loaded:\n  missing: transformer.ln_f.bias\n  unexpected: transformer.h.0.attn.rotary.weight"):
        GPT2LMHeadModel.from_pretrained(d)
    save_file({k.removeprefix("transformer."): v for k, v in state.items()}, d / "model.safetensors")  # the file's keys unprefixed
    with pytest.raises(ValueError, match=r"nothing was loaded:\n  missing: ln_f.bias\n  unexpected: h.0.attn.rotary.weight"):
        GPT2LMHeadModel.from_pretrained(d)  # each named as the file names its keys


def test_untied_lm_head_is_refused(hf_gpt2, tmp_path):
    state = {k: v.clone() for k, v in hf_gpt2.state_dict().items()}
    state["lm_head.weight"] += 1.0
    torch.save(state, tmp_path / "pytorch_model.bin")
    hf_gpt2.config.to_json_file(tmp_path / "config.json")
    del state["transformer.ln_f.bias"]
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model.bin; nothing was loaded:\n  lm_head.weight differs from transformer.wte.weight; "
                                         r"headwise's GPT-2 ties them \(tie_word_embeddings\)\n  missing: transformer.ln_f.bias$"):
        GPT2LMHeadModel.from_pretrained(tmp_path)  # with every other problem of the file


def test_truncated_safetensors(gpt2_dir, tmp_path):
    d = copy_of(gpt2_dir, tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    for cut in (len(data) // 2, 5):  # cut in the tensors, cut in the header
        (d / "model.safetensors").write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"model.safetensors: cannot read it as safetensors, the file is truncated or corrupt"):
            GPT2LMHeadModel.from_pretrained(d)


def test_truncated_or_unsafe_pytorch_bin(hf_gpt2, tmp_path):
    hf_gpt2.config.to_json_file(tmp_path / "config.json")
    torch.save(hf_gpt2.state_dict(), tmp_path / "pytorch_model.bin")
    data = (tmp_path / "pytorch_model.bin").read_bytes()
    (tmp_path / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"pytorch_model.bin: cannot read it as a PyTorch checkpoint, the file is truncated or corrupt"):
        GPT2LMHeadModel.from_pretrained(tmp_path)
    torch.save({"weights": hf_gpt2.state_dict(), "hook": Path("x")}, tmp_path / "pytorch_model.bin")  # an arbitrary object
    with pytest.raises(ValueError, match=r"pytorch_model.bin: refused to load: it holds more than tensors \(read with weights_only=True: objects whose "
                                         r"loading runs code are never unpickled\); re-save the weights with safetensors"):
        GPT2LMHeadModel.from_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(bytes(range(256)) * 4)  # no checkpoint at all: not "more than tensors"
    with pytest.raises(ValueError, match=r"pytorch_model.bin: cannot read it as a PyTorch checkpoint, the file is truncated or corrupt"):
        GPT2LMHeadModel.from_pretrained(tmp_path)
    torch.save([torch.zeros(2)], tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model.bin: expected a dict of tensors \(a state dict\), got list"):
        GPT2LMHeadModel.from_pretrained(tmp_path)


def test_a_failed_load_leaves_the_model_unchanged(gpt2_dir):
    model = GPT2LMHeadModel.from_pretrained(gpt2_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = load_file(gpt2_dir / "model.safetensors")
    state = {k: (v + 1.0 if v.is_floating_point() else v) for k, v in state.items()}
    state.pop("transformer.h.1.mlp.c_fc.bias")  # the last problem found comes after most tensors would have loaded
    with pytest.raises(ValueError, match=r"missing: transformer.h.1.mlp.c_fc.bias"):
        load_checked(model, state, source=gpt2_dir / "model.safetensors", transposed=("c_attn.weight", "c_proj.weight", "c_fc.weight"))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_key_with_and_without_its_prefix_is_refused(gpt2_dir, tmp_path):
    d = copy_of(gpt2_dir, tmp_path / "m")
    state = load_file(d / "model.safetensors")
    state["h.0.attn.c_attn.bias"] = state["transformer.h.0.attn.c_attn.bias"] + 1  # both map to one parameter
    save_file(state, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"duplicate: (transformer\.)?h.0.attn.c_attn.bias and (transformer\.)?h.0.attn.c_attn.bias both give transformer.h.0.attn.c_attn.bias"):
        GPT2LMHeadModel.from_pretrained(d)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"layer_norm_epsilon": -1}, r"config.json: invalid GPT-2 config: layer_norm_epsilon must be a number in \(0, inf\), got -1"),
        ({"layer_norm_epsilon": float("nan")}, r"config.json: invalid GPT-2 config: layer_norm_epsilon must be a number in \(0, inf\), got nan"),
        ({"n_head": "2"}, r"config.json: invalid GPT-2 config: n_head must be a positive int, got '2'"),
        ({"n_inner": 256.0}, r"config.json: invalid GPT-2 config: n_inner must be an int or null, got 256.0"),  # (4 * n_embd, a float)
        ({"tie_word_embeddings": 1}, r"config.json: invalid GPT-2 config: tie_word_embeddings must be true or false, got 1"),
        ({"add_cross_attention": 0}, r"config.json: invalid GPT-2 config: add_cross_attention must be true or false, got 0"),
    ],
)
def test_config_values_are_checked_with_the_file_named(gpt2_dir, tmp_path, changes, match):
    d = copy_of(gpt2_dir, tmp_path / "m")
    edit_config(d, **changes)
    with pytest.raises(ValueError, match=match):
        GPT2LMHeadModel.from_pretrained(d)


@pytest.mark.slow
def test_a_huge_config_against_a_small_file_fails_before_allocating(gpt2_dir, tmp_path):
    """config.json promises ~150 GB of weights; the small file must give the clear error, not an out-of-memory kill."""
    d = copy_of(gpt2_dir, tmp_path / "m")
    edit_config(d, n_embd=8192, n_layer=48, n_head=64)
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))  # far below what the config would take\n"
        "from headwise.models import GPT2LMHeadModel\n"
        "try:\n"
        f"    GPT2LMHeadModel.from_pretrained({str(d)!r})\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "model.safetensors; nothing was loaded" in run.stdout
    assert "wrong shape: transformer.wte.weight: expected (" in run.stdout and ", 8192), got (" in run.stdout


def test_training_checkpoints_and_garbage_bin_files(hf_gpt2, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_gpt2.config.to_dict()))
    torch.save({"state_dict": hf_gpt2.state_dict(), "epoch": torch.tensor(3)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model.bin: expected a dict of tensors \(a state dict\), got a dict whose entry 'state_dict' is a dict \(a training checkpoint\?\)"):
        GPT2LMHeadModel.from_pretrained(tmp_path)
    torch.save({**hf_gpt2.state_dict(), 3: torch.zeros(1)}, tmp_path / "pytorch_model.bin")  # a key, not a value, at fault
    with pytest.raises(ValueError, match=r"pytorch_model.bin: expected a dict of tensors by name \(a state dict\), got the key 3 of type int"):
        GPT2LMHeadModel.from_pretrained(tmp_path)
    for garbage in (b"\x80", b"hello world", b"\x80\x02}q\x00.", b""):  # IndexError, KeyError, ... escaped before
        (tmp_path / "pytorch_model.bin").write_bytes(garbage)
        with pytest.raises(ValueError, match=r"pytorch_model.bin: cannot read it as a PyTorch checkpoint, the file is truncated or corrupt"):
            GPT2LMHeadModel.from_pretrained(tmp_path)


def test_a_float8_checkpoint_is_refused_as_quantized(gpt2_dir, tmp_path):
    """8-bit floats hold a quantized checkpoint's values without their scales: refused by name, as int8 is (they were
    taken as the model's dtype, which then ran no op)."""
    from safetensors.torch import load_file, save_file

    d = copy_of(gpt2_dir, tmp_path / "m")
    state = load_file(d / "model.safetensors")
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in state.items()}, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors: holds float8 \(quantized\) weights, e.g. .*headwise loads float checkpoints only"):
        GPT2LMHeadModel.from_pretrained(d)


@pytest.mark.parametrize("width", [None, "768", 0, True])
def test_a_gpt2_config_with_no_usable_n_embd_is_named(gpt2_dir, tmp_path, width):
    d = copy_of(gpt2_dir, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "n_embd": width}))
    with pytest.raises(ValueError, match=rf"config.json: invalid GPT-2 config: n_embd must be a positive int, got {re.escape(repr(width))}"):
        GPT2LMHeadModel.from_pretrained(d)
