"""Every file a run reads is an input no output may touch: the model file, the autoencoder given or
linked, an exported decoder, an engine's metadata, the data a mode reads.

Specification: for every mode, an output that is (directly, through a symlink, or as a hard link) the
autoencoder a latent checkpoint names, or the decoder an exported latent model names, or an image of the
folder evaluate judges against, is refused in one line with exit 2 before any work, and the input is
left byte for byte as it was.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers import needs_onnx, perturbed_unet, tiny_unet_config
from PIL import Image

import main
from ddpm.util.safe_files import atomic_write
from noise_schedule import ScheduleConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TINY = [
    "--model_channels",
    "8",
    "--num_res_blocks",
    "1",
    "--max_steps",
    "2",
    "--batch_size",
    "8",
    "--timesteps",
    "20",
    "--save_every",
    "0",
    "--sample_every",
    "0",
]


@pytest.fixture(scope="module")
def files(latent_export):
    """ae.pt, a latent model lat.pt linked to it and its ONNX export (tests/conftest.py's, shared with other
    modules), and a pixel model of an image folder (data/) added beside them."""
    folder, _ = latent_export
    data = folder / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8)).save(data / f"img{i}.png")
    train = [
        "--device",
        "cpu",
        "--mode",
        "train",
        "--dataset",
        "folder",
        "--data_dir",
        str(data),
        "--img_size",
        "8",
        "--channels",
        "1",
        *TINY,
        "--model_path",
        str(folder / "pix.pt"),
    ]
    assert main.main(train) == 0
    return folder


def refused(args: list[str], victim, capsys, match: str) -> None:
    before = victim.read_bytes()
    assert main.main(["--device", "cpu", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err
    assert victim.read_bytes() == before


def alias(kind: str, target, path):
    """``path`` naming ``target``: a symlink or a hard link."""
    path.unlink(missing_ok=True)
    (os.symlink if kind == "symlink" else os.link)(target, path)
    return path


@pytest.mark.parametrize("kind", ["symlink", "hard link"])
def test_no_output_of_any_mode_may_be_the_autoencoder_a_checkpoint_links(files, tmp_path, capsys, kind):
    ae, lat = files / "ae.pt", str(files / "lat.pt")
    sample = ["--mode", "sample", "--model_path", lat, "--n_samples", "2", "--sampling_steps", "2", "--sampler", "ddim"]
    runs = {
        "--output": [*sample, "--output", str(alias(kind, ae, tmp_path / "grid.png"))],
        "--save_npz": [
            *sample,
            "--output",
            str(tmp_path / "g.png"),
            "--save_npz",
            str(alias(kind, ae, tmp_path / "s.npz")),
        ],
        "--json": [
            "--mode",
            "benchmark",
            "--model_path",
            lat,
            "--n_samples",
            "2",
            "--sampling_steps",
            "2",
            "--rows",
            "original",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--json",
            str(alias(kind, ae, tmp_path / "b.json")),
        ],
        "--chart": [
            "--mode",
            "evaluate",
            "--model_path",
            lat,
            "--n_samples",
            "2",
            "--sampling_steps",
            "2",
            "--chart",
            str(alias(kind, ae, tmp_path / "c.png")),
        ],
        "--output's decoder": [
            "--mode",
            "export",
            "--format",
            "torchscript",
            "--model_path",
            lat,
            "--output",
            str(tmp_path / "x.ts"),
        ],
    }
    alias(kind, ae, tmp_path / "x.decoder.ts")
    for flag, args in runs.items():
        refused(args, ae, capsys, f"{flag} ")


def test_an_output_that_names_the_linked_autoencoder_is_refused_by_its_kind_before_the_model_is_read(
    files, tmp_path, capsys
):
    # (the link is known only once lat.pt is read; what the file holds is known from its first bytes)
    link = alias("symlink", files / "ae.pt", tmp_path / "grid.png")
    args = [
        "--mode",
        "sample",
        "--model_path",
        str(files / "lat.pt"),
        "--n_samples",
        "2",
        "--sampling_steps",
        "2",
        "--sampler",
        "ddim",
        "--output",
        str(link),
    ]
    refused(args, files / "ae.pt", capsys, "grid.png already holds a PyTorch checkpoint, not a PNG image")


@pytest.fixture(scope="module")
def exported(files):
    """lat.pt's ONNX export beside it: lat.onnx and the decoder it names, lat.decoder.onnx."""
    return files / "lat.onnx"


@needs_onnx
def test_sampling_an_exported_latent_model_never_writes_over_its_decoder(files, exported, tmp_path, capsys):
    onnx, decoder = exported, files / "lat.decoder.onnx"
    args = [
        "--mode",
        "sample",
        "--model_path",
        str(onnx),
        "--implementation",
        "onnxruntime",
        "--n_samples",
        "2",
        "--sampling_steps",
        "2",
        "--sampler",
        "ddim",
        "--output",
        str(alias("symlink", decoder, tmp_path / "g.png")),
    ]
    refused(args, decoder, capsys, "g.png already holds an ONNX graph")  # by its kind, before the export is read


def test_evaluate_never_writes_over_the_images_it_judges_against(files, capsys):
    image = files / "data" / "img3.png"
    args = [
        "--mode",
        "evaluate",
        "--model_path",
        str(files / "pix.pt"),
        "--data_dir",
        str(files / "data"),
        "--n_samples",
        "2",
        "--sampling_steps",
        "2",
        "--chart",
        str(image),
    ]
    refused(args, image, capsys, "is inside the folder --data_dir reads")


# Every mode's outputs against every kind of input a run reads, through a symlink and a hard link.
DRAW = ["--n_samples", "2", "--sampling_steps", "2", "--sampler", "ddim"]
OUTPUTS = {  # mode: (its arguments, {output flag: a file name with the suffix it takes})
    "sample": (["--mode", "sample", *DRAW], {"--output": "g.png", "--save_npz": "s.npz"}),
    "evaluate": (["--mode", "evaluate", *DRAW], {"--json": "e.json", "--chart": "e.png"}),
    "benchmark": (
        ["--mode", "benchmark", *DRAW, "--rows", "original", "--repeats", "1", "--warmup", "0"],
        {"--json": "b.json", "--csv": "b.csv", "--chart": "b.png"},
    ),
    "export": (["--mode", "export", "--format", "torchscript"], {"--output": "x.ts"}),
}


def input_matrix(files, onnx):
    """(name, arguments naming the model, the files it reads, the modes that take it) for each kind of model."""
    image = files / "data" / "img5.png"
    folder = files / "diffusers"  # a diffusers model folder: every file in it is an input
    if not folder.exists():
        from ddpm.backends.artifacts import write_diffusers_folder

        model = perturbed_unet(tiny_unet_config(image_size=8, norm_groups=8, attention_resolutions=(4,)))
        write_diffusers_folder(model, ScheduleConfig(num_timesteps=20), folder, source="test")
    folder_files = [
        folder / "unet" / "config.json",
        folder / "unet" / "diffusion_pytorch_model.safetensors",
        folder / "scheduler" / "scheduler_config.json",
    ]
    return [
        ("diffusers folder", ["--model_path", str(folder)], folder_files, ["sample", "benchmark", "export"]),
        (
            "latent checkpoint",
            ["--model_path", str(files / "lat.pt")],
            [files / "lat.pt", files / "ae.pt"],
            list(OUTPUTS),
        ),
        (
            "exported latent model",
            ["--model_path", str(onnx), "--implementation", "onnxruntime"],
            [onnx, files / "lat.decoder.onnx"],
            ["sample", "evaluate"],
        ),
        (
            "pixel checkpoint of a folder",
            ["--model_path", str(files / "pix.pt"), "--data_dir", str(files / "data")],
            [files / "pix.pt", image],
            ["evaluate"],
        ),
    ]


@needs_onnx
@pytest.mark.parametrize("kind", ["symlink", "hard link"])
def test_every_output_of_every_mode_is_refused_when_it_is_any_input_of_the_run(files, exported, tmp_path, capsys, kind):
    runs = 0
    for name, model, inputs, modes in input_matrix(files, exported):
        for mode in modes:
            args, outputs = OUTPUTS[mode]
            for flag, file_name in outputs.items():
                for victim in inputs:
                    out = alias(kind, victim, tmp_path / file_name)
                    before = victim.read_bytes()
                    assert main.main(["--device", "cpu", *args, *model, flag, str(out)]) == 2, (
                        name,
                        mode,
                        flag,
                        victim,
                    )
                    err = capsys.readouterr().err.strip()
                    assert len(err.splitlines()) == 1 and flag in err, (name, mode, flag, victim, err)
                    assert victim.read_bytes() == before
                    out.unlink()
                    runs += 1
    assert runs == 3 * (2 + 3 + 1) + 2 * (2 + 2 + 3 + 1) + 2 * (2 + 2) + 2 * 2  # every pair above was tried
    # Training writes its checkpoint: never onto the autoencoder it reads or an image of its folder (even with
    # --overwrite).
    trains = [
        (["--mode", "train", "--dataset", "digits", "--autoencoder", str(files / "ae.pt"), *TINY], files / "ae.pt"),
        (
            [
                "--mode",
                "train",
                "--dataset",
                "folder",
                "--data_dir",
                str(files / "data"),
                "--img_size",
                "8",
                "--channels",
                "1",
                *TINY,
            ],
            files / "data" / "img5.png",
        ),
        (
            [
                "--mode",
                "train_autoencoder",
                "--dataset",
                "folder",
                "--data_dir",
                str(files / "data"),
                "--img_size",
                "8",
                "--channels",
                "1",
                "--max_steps",
                "2",
            ],
            files / "data" / "img5.png",
        ),
    ]
    for args, victim in trains:
        out = alias(kind, victim, tmp_path / "m.pt")
        refused([*args, "--overwrite", "--model_path", str(out)], victim, capsys, "--model_path")
        out.unlink()


@pytest.mark.parametrize("kind", ["symlink", "hard link"])
def test_the_training_previews_are_outputs_never_written_over_an_input(files, tmp_path, capsys, kind):
    """<model_path stem>_samples/step_NNNNNNN.png, written at the end of a run, may not be the autoencoder or a
    data image (before the fix the preview went through the link and replaced them, exit 0)."""
    runs = [
        (["--mode", "train", "--dataset", "digits", "--autoencoder", str(files / "ae.pt"), *TINY], files / "ae.pt"),
        (
            [
                "--mode",
                "train",
                "--dataset",
                "folder",
                "--data_dir",
                str(files / "data"),
                "--img_size",
                "8",
                "--channels",
                "1",
                *TINY,
            ],
            files / "data" / "img2.png",
        ),
    ]
    for args, victim in runs:
        (tmp_path / "m_samples").mkdir(exist_ok=True)
        preview = alias(kind, victim, tmp_path / "m_samples" / "step_0000002.png")  # TINY: --max_steps 2
        refused([*args, "--overwrite", "--model_path", str(tmp_path / "m.pt")], victim, capsys, "the training preview")
        assert not (tmp_path / "m.pt").exists()  # refused before the first step
        preview.unlink()
    (tmp_path / "m_samples").rmdir()
    (tmp_path / "m_samples").write_bytes(b"a file where the previews' folder goes")
    refused(
        [*runs[0][0], "--model_path", str(tmp_path / "m.pt")],
        tmp_path / "m_samples",
        capsys,
        "m_samples, which is a file",
    )


def test_a_checkpoint_cannot_make_the_tool_read_a_file_outside_its_folder(files, tmp_path, capsys):
    """A latent checkpoint's stored autoencoder path is followed only inside the checkpoint's folder: a hostile
    link (/etc/passwd, /proc/kmsg, which hung sampling) is refused before anything is opened, without saying
    whether the file exists; --autoencoder, the user's word, still names any file."""
    state = torch.load(files / "lat.pt", weights_only=True)
    sample = [
        "--mode",
        "sample",
        "--n_samples",
        "2",
        "--sampling_steps",
        "2",
        "--sampler",
        "ddim",
        "--no_grid",
        "--save_npz",
        str(tmp_path / "s.npz"),
    ]
    for target in ("/etc/passwd", "/nonexistent/ae.pt", str(files / "ae.pt"), "/proc/kmsg"):
        state["autoencoder"]["path"] = target
        atomic_write(tmp_path / "lat.pt", lambda f: torch.save(state, f))
        assert main.main(["--device", "cpu", *sample, "--model_path", str(tmp_path / "lat.pt")]) == 2
        err = capsys.readouterr().err.strip()
        assert (
            len(err.splitlines()) == 1 and "outside the checkpoint's folder" in err and f"--autoencoder {target}" in err
        ), err
    args = ["--device", "cpu", *sample, "--model_path", str(tmp_path / "lat.pt"), "--autoencoder", str(files / "ae.pt")]
    assert main.main(args) == 0, capsys.readouterr().err
