"""A model folder is a boundary, and its configs go through the same typed door as this tool's own files.

Diffusers folders are written here by this tool's own exporter (no diffusers needed): tiny U-Nets whose
norm groups divide every width, so UNet2DModel can represent them.
"""

from __future__ import annotations

import json
import os
import shutil
import stat

import pytest
import torch
from helpers import (
    TINY_SCHEDULE,
    assert_user_error,
    folder_bytes,
    perturbed_unet,
    run_here,
    save_weights_only,
    tiny_unet_config,
)

from ddpm.backends import artifacts
from ddpm.formats.checkpoints import load_checkpoint, save_checkpoint
from ddpm.formats.diffusers_io import (
    diffusers_scheduler_config,
    diffusers_unet_config,
    schedule_config_from_diffusers,
    unet_config_from_diffusers,
)

WEIGHTS = "diffusion_pytorch_model.safetensors"
SECRET = b"SECRET!!"  # the first eight bytes of a file outside the folder: read as a header length, a number


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A pipeline folder (unet/, scheduler/) of a tiny U-Net; tests copy it before changing it."""
    folder = tmp_path_factory.mktemp("models") / "pipeline"
    model = perturbed_unet(tiny_unet_config(norm_groups=8))
    artifacts.write_diffusers_folder(model, TINY_SCHEDULE, folder, source="test")
    return folder


@pytest.fixture
def folder(model_folder, tmp_path):
    return shutil.copytree(model_folder, tmp_path / "model")


def _outside(tmp_path, data: bytes):
    path = tmp_path / "elsewhere" / "secret.bin"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return path


def _refused(folder, match: str) -> str:
    with pytest.raises(ValueError, match=match) as info:
        artifacts.load_model_state(folder)
    message = str(info.value)
    assert "\n" not in message
    assert str(int.from_bytes(SECRET, "little")) not in message.replace(",", "")
    assert "SECRET" not in message
    return message


def test_the_exported_folder_reads_back(folder):
    state = artifacts.load_model_state(folder)
    assert state["model_config"]["norm_groups"] == 8


@pytest.mark.parametrize("name", [f"unet/{WEIGHTS}", "unet/config.json", "scheduler/scheduler_config.json"])
def test_a_file_symlinked_outside_its_folder_is_refused_even_when_it_is_a_valid_model_file(folder, tmp_path, name):
    inside = folder / name
    target = _outside(tmp_path, inside.read_bytes())  # the same, valid bytes: only where they live differs
    inside.unlink()
    inside.symlink_to(target)
    _refused(folder, "leads outside")


def test_a_symlinked_non_safetensors_file_leaks_none_of_its_bytes(folder, tmp_path):
    weights = folder / "unet" / WEIGHTS
    weights.unlink()
    weights.symlink_to(_outside(tmp_path, SECRET + b"the rest of a private file"))
    _refused(folder, "leads outside")
    weights.unlink()
    weights.write_bytes(SECRET + b"the rest of a private file")  # inside, but junk: named, not quoted
    _refused(folder, "is not a safetensors file")


def test_a_symlink_that_stays_inside_the_folder_is_followed(folder):
    weights = folder / "unet" / WEIGHTS
    weights.rename(folder / "weights.safetensors")
    weights.symlink_to("../weights.safetensors")
    assert artifacts.load_model_state(folder)["step"] == 0


@pytest.mark.parametrize("name", [f"unet/{WEIGHTS}", "unet/config.json", "scheduler/scheduler_config.json"])
def test_fifos_and_folders_in_place_of_a_models_files_are_refused_without_blocking(folder, name):
    path = folder / name
    path.unlink()
    os.mkfifo(path)  # opened blocking, a FIFO would wait for a writer forever
    _refused(folder, "not a regular file")
    path.unlink()
    path.mkdir()
    _refused(folder, "is a folder")


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_a_device_in_place_of_the_weights_is_refused(folder):
    weights = folder / "unet" / WEIGHTS
    weights.unlink()
    os.mknod(weights, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers: endless bytes
    _refused(folder, "not a regular file")


def test_init_from_a_folder_with_an_outside_symlink_is_one_line(folder, tmp_path):
    weights = folder / "unet" / WEIGHTS
    weights.unlink()
    weights.symlink_to(_outside(tmp_path, SECRET * 100))
    result = run_here(
        "--mode", "train", "--dataset", "digits", "--init_from", str(folder), "--model_path", "ft.pt", cwd=tmp_path
    )
    assert_user_error(result, "leads outside")
    assert SECRET.decode() not in result.stderr
    assert not (tmp_path / "ft.pt").exists()


def test_an_exported_decoder_symlinked_elsewhere_is_refused_before_it_is_read(tmp_path):
    from ddpm.backends.artifacts import load_exported_decoder

    unet = tmp_path / "export" / "m.onnx"
    decoder = tmp_path / "export" / "m.decoder.onnx"
    decoder.parent.mkdir()
    decoder.symlink_to(_outside(tmp_path, SECRET * 10))
    entry = {"file": decoder.name, "sha256": "0" * 64, "latent_shape": [4, 8, 8], "image_shape": [1, 32, 32]}
    config = tiny_unet_config(image_size=8, in_channels=4, channel_mult=(1,), attention_resolutions=())
    with pytest.raises(ValueError, match="leads outside") as info:
        load_exported_decoder(entry, path=unet, kind="onnx", model_config=config, device=torch.device("cpu"))
    assert "SECRET" not in str(info.value)


# ----- one typed door ------------------------------------------------------------------------------------

UNET_JUNK = [
    ("layers_per_block", 2.0),
    ("layers_per_block", True),
    ("layers_per_block", "1"),
    ("block_out_channels", [16.0, 32]),
    ("block_out_channels", [16, "32"]),
    ("block_out_channels", [16] * 17),
    ("block_out_channels", [10**400, 10**400]),
    ("block_out_channels", {"a": 16}),
    ("norm_num_groups", 8.0),
    ("norm_num_groups", [8]),
    ("down_block_types", [["DownBlock2D"], "AttnDownBlock2D"]),
    ("up_block_types", "AttnUpBlock2D"),
    ("norm_eps", 10**400),
    ("norm_eps", float("inf")),
    ("norm_eps", "1e-5"),
    ("dropout", 10**400),
    ("dropout", float("nan")),
    ("dropout", [0.0]),
    ("freq_shift", 0.5),
    ("freq_shift", "1"),
    ("freq_shift", True),
    ("freq_shift", [1]),
    ("flip_sin_to_cos", 1),
    ("sample_size", "16"),
    ("sample_size", [16, 8]),
    ("sample_size", 16.0),
    ("sample_size", 10**400),
    ("in_channels", True),
    ("out_channels", 1.0),
    ("attention_head_dim", 16.0),
    ("attention_head_dim", [16]),
    ("num_class_embeds", 11.0),
    ("resnet_time_scale_shift", ["default"]),
    ("resnet_time_scale_shift", {"x": 1}),
    ("attn_norm_num_groups", "8"),
    ("downsample_padding", 1.0),
    ("mid_block_scale_factor", [1]),
]
SCHEDULER_JUNK = [
    ("num_train_timesteps", 1000.0),
    ("num_train_timesteps", "1000"),
    ("num_train_timesteps", True),
    ("num_train_timesteps", 10**400),
    ("beta_end", 10**400),
    ("beta_end", float("inf")),
    ("beta_end", "0.02"),
    ("beta_start", [0.0001]),
    ("beta_schedule", ["linear"]),
    ("beta_schedule", {"linear": 1}),
    ("prediction_type", ["epsilon"]),
    ("rescale_betas_zero_snr", 0),
    ("variance_type", ["fixed_small"]),
]


@pytest.fixture(scope="module")
def configs():
    model = perturbed_unet(tiny_unet_config(norm_groups=8))
    return diffusers_unet_config(model.config, source="test"), diffusers_scheduler_config(TINY_SCHEDULE, source="x")


@pytest.mark.parametrize("key, value", UNET_JUNK, ids=[f"{k}={str(v)[:12]}" for k, v in UNET_JUNK])
def test_unet_configs_with_wrong_types_or_sizes_are_one_value_error(configs, key, value):
    with pytest.raises(ValueError, match="config.json: ") as info:
        unet_config_from_diffusers(configs[0] | {key: value}, source="config.json")
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


@pytest.mark.parametrize("key, value", SCHEDULER_JUNK, ids=[f"{k}={str(v)[:12]}" for k, v in SCHEDULER_JUNK])
def test_scheduler_configs_with_wrong_types_or_sizes_are_one_value_error(configs, key, value):
    with pytest.raises(ValueError, match="scheduler_config.json") as info:
        schedule_config_from_diffusers(configs[1] | {key: value}, source="scheduler_config.json")
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


def test_a_config_without_block_out_channels_is_refused_for_that(configs):
    config = {k: v for k, v in configs[0].items() if k != "block_out_channels"}
    with pytest.raises(ValueError, match="no block_out_channels"):
        unet_config_from_diffusers(config, source="config.json")


@pytest.mark.parametrize("key, value", [("freq_shift", 0.5), ("layers_per_block", 1.0), ("norm_eps", 10**400)])
def test_wrong_types_in_a_folders_config_end_in_one_line_exit_2(folder, tmp_path, key, value):
    config = folder / "unet" / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {key: value}))
    result = run_here("--mode", "sample", "--model_path", str(folder), "--output", "s.png", cwd=tmp_path)
    assert_user_error(result, key)
    assert not (tmp_path / "s.png").exists()


OWN_JUNK = [
    ("model_config", "num_res_blocks", 1.0),
    ("model_config", "model_channels", "16"),
    ("model_config", "channel_mult", [1.0, 2]),
    ("model_config", "channel_mult", [[1], 2]),
    ("model_config", "dropout", 10**400),
    ("model_config", "norm_eps", float("inf")),
    ("model_config", "freq_shift", True),
    ("model_config", "time_conditioning", ["add"]),
    ("model_config", "image_size", 10**400),
    ("schedule_config", "num_timesteps", 50.0),
    ("schedule_config", "beta_end", 10**400),
    ("schedule_config", "kind", ["linear"]),
    ("schedule_config", "cosine_s", {"s": 1}),
]


@pytest.mark.parametrize("entry, key, value", OWN_JUNK, ids=[f"{k}={str(v)[:12]}" for _, k, v in OWN_JUNK])
def test_this_tools_own_configs_pass_the_same_typed_door(entry, key, value):
    """A checkpoint's or an export's metadata configs (checkpoints.read_configs): the same refusals, one line."""
    from ddpm.formats.checkpoints import read_configs

    meta = {"model_config": tiny_unet_config().to_dict(), "schedule_config": vars(TINY_SCHEDULE)}
    meta[entry] = meta[entry] | {key: value}
    with pytest.raises(ValueError, match=f"m.pt: its {entry.replace('_', ' ')} is unusable") as info:
        read_configs(meta, source="m.pt")
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


@pytest.mark.parametrize("layout", ["sparse", "meta"])
def test_a_checkpoint_holding_a_sparse_or_meta_tensor_is_refused_in_one_line(tmp_path, layout):
    model = perturbed_unet(tiny_unet_config())
    weights = dict(model.state_dict())
    name = "conv_in.weight"
    weights[name] = weights[name].to_sparse() if layout == "sparse" else torch.empty_like(weights[name], device="meta")
    state = {
        "format_version": 1,
        "model_config": model.config.to_dict(),
        "schedule_config": vars(TINY_SCHEDULE),
        "model": weights,
        "ema": weights,
        "step": 0,
    }
    save_checkpoint(tmp_path / "m.pt", state)
    with pytest.raises(ValueError, match=f"'{name}' is a .* tensor on .*; only dense CPU tensors"):
        load_checkpoint(tmp_path / "m.pt")


# ----- exports never change what an existing folder means ---------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path):
    return save_weights_only(tmp_path / "m.pt", perturbed_unet(tiny_unet_config(norm_groups=8), std=0.1))


def _same_weights(folder, checkpoint) -> bool:
    ours = load_checkpoint(checkpoint)["ema"]
    theirs = artifacts.load_model_state(folder)["ema"]
    return all(torch.equal(ours[k], theirs[k]) for k in ours)


def _siblings(folder) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}."))


def _export(checkpoint, output, *flags: str) -> list[str]:
    return [
        "--mode",
        "export",
        "--format",
        "diffusers",
        "--model_path",
        str(checkpoint),
        "--output",
        str(output),
        *flags,
    ]


def _user_files(folder) -> dict:
    """A folder of the user's own files (notes, a picture in a sub-folder, a file named like an export's folder)."""
    folder.mkdir(exist_ok=True)
    (folder / "notes.txt").write_text("my notes")
    (folder / "pics").mkdir()
    (folder / "pics" / "cat.png").write_bytes(b"\x89PNG not really")
    return folder_bytes(folder)


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
def test_an_export_into_a_folder_of_the_users_files_is_refused_and_deletes_nothing(checkpoint, tmp_path, overwrite):
    """Found by the adversarial pass: the export merged into such a folder (exit 0), and with --overwrite deleted
    every file in it. A folder export writes a new folder or its own earlier export, nothing else, in either case."""
    mine = tmp_path / "mine"
    before = _user_files(mine)
    result = run_here(*_export(checkpoint, "mine", *(["--overwrite"] if overwrite else [])), cwd=tmp_path)
    assert_user_error(result, "--output mine holds notes.txt and 1 more, which --format diffusers does not write")
    assert str(tmp_path) not in result.stderr  # the path as the user typed it
    assert folder_bytes(mine) == before and _siblings(mine) == []


@pytest.mark.parametrize("output, what", [(".", "is the working folder"), ("..", "holds the working folder")])
def test_an_export_onto_the_working_folder_or_above_it_is_refused(checkpoint, tmp_path, output, what):
    """--output . with --overwrite removed the working folder itself."""
    work = tmp_path / "work"
    before = _user_files(work)
    identity = os.stat(work).st_ino
    result = run_here(*_export(checkpoint, output, "--overwrite"), cwd=work)
    assert_user_error(result, f"--output {output} {what}")
    assert os.stat(work).st_ino == identity and folder_bytes(work) == before and checkpoint.is_file()


def test_an_export_into_another_tools_model_folder_is_refused_even_with_overwrite(folder, checkpoint, tmp_path):
    """A bare UNet2DModel folder (config.json and weights at its top) holds files this export does not write:
    --overwrite would have to delete them, so it is refused as any folder of other files is."""
    bare = tmp_path / "bare"
    shutil.copytree(folder / "unet", bare)
    before = folder_bytes(bare)
    for flags in ([], ["--overwrite"]):
        assert_user_error(run_here(*_export(checkpoint, bare, *flags), cwd=tmp_path), "does not write")
        assert folder_bytes(bare) == before and _siblings(bare) == []


def test_an_export_onto_the_folder_it_reads_is_refused(folder, tmp_path):
    before = folder_bytes(folder)
    for flags in ([], ["--overwrite"]):
        assert_user_error(run_here(*_export(folder, folder, *flags), cwd=tmp_path), "is the model --model_path names")
        assert folder_bytes(folder) == before and _siblings(folder) == []


def test_an_export_into_a_folder_holding_its_input_is_refused(checkpoint, tmp_path):
    (tmp_path / "model_index.json").write_text("{}")  # tmp_path now looks like a model folder, and holds m.pt
    elsewhere = tmp_path.parent
    result = run_here(*_export(checkpoint, tmp_path, "--overwrite"), cwd=elsewhere)
    assert_user_error(result, "holds --model_path, an input")
    assert checkpoint.is_file() and (tmp_path / "model_index.json").read_text() == "{}"


def test_overwrite_replaces_only_the_exports_own_files_in_the_same_folder(checkpoint, tmp_path):
    """An earlier export needs --overwrite; then its files are replaced (written beside the folder, read back, moved
    in): the folder itself stays (same inode, same mode), and nothing is left beside it."""
    assert run_here(*_export(checkpoint, "out"), cwd=tmp_path).returncode == 0
    out = tmp_path / "out"
    out.chmod(0o750)
    identity = os.stat(out).st_ino
    assert_user_error(run_here(*_export(checkpoint, "out"), cwd=tmp_path), "already holds an export")
    other = perturbed_unet(tiny_unet_config(norm_groups=8), std=0.2)  # another model, so the weights change
    state = load_checkpoint(checkpoint) | {"model": other.state_dict(), "ema": other.state_dict()}
    save_checkpoint(tmp_path / "n.pt", state)
    result = run_here(*_export(tmp_path / "n.pt", "out", "--overwrite"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert os.stat(out).st_ino == identity and stat.S_IMODE(os.stat(out).st_mode) == 0o750
    assert sorted(folder_bytes(out)) == [
        "ddpm_export.json",
        "model_index.json",
        "scheduler/scheduler_config.json",
        "unet/config.json",
        f"unet/{WEIGHTS}",
    ]
    assert _same_weights(out, tmp_path / "n.pt") and _siblings(out) == []


def test_an_interrupted_replacement_leaves_the_old_files_and_touches_no_other(folder):
    from ddpm.util.model_folders import replaced_files

    names = ["unet/config.json", "model_index.json"]
    (folder / "keep.txt").write_text(
        "not the writer's"
    )  # (an export refuses such a folder; the helper never touches it)
    before = folder_bytes(folder)
    with pytest.raises(KeyboardInterrupt), replaced_files(folder, names) as new:
        (new / "model_index.json").write_text("{}")
        raise KeyboardInterrupt  # stopped mid-export
    assert folder_bytes(folder) == before and _siblings(folder) == []
    with replaced_files(folder, names) as new:
        (new / "model_index.json").write_text("{}")  # unet/config.json not written this time: removed
    after = folder_bytes(folder)
    assert (
        after["model_index.json"] == b"{}"
        and "unet/config.json" not in after
        and after["keep.txt"] == b"not the writer's"
    )
    assert {name: data for name, data in after.items() if name not in names} == {
        name: data for name, data in before.items() if name not in names
    }
    assert _siblings(folder) == []


def test_an_onnx_file_given_to_export_is_called_an_onnx_file(tmp_path):
    (tmp_path / "m.onnx").write_bytes(b"\x08\x07")
    result = run_here(
        "--mode", "export", "--format", "onnx", "--model_path", "m.onnx", "--output", "o.onnx", cwd=tmp_path
    )
    assert_user_error(result, "m.onnx is an ONNX file, which --format onnx does not read")
    assert "corrupt" not in result.stderr and not (tmp_path / "o.onnx").exists()
