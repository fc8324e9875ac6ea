"""ddpm/requests.py's OUTPUTS: every output of every mode, in one table, is held to its kind: a name that does not
end as its kind's files do is refused, and an existing file of another kind is refused and left byte for byte, before
any work (a flag's refusal comes while the request is built, before any model file is read)."""

from __future__ import annotations

import io

import pytest
import torch
from helpers import assert_user_error, run_here
from PIL import Image

from ddpm.cli import parser, resolve
from ddpm.cli.flags import FLAGS
from ddpm.requests import OUTPUTS, check_mode_outputs, kinds_of
from ddpm.util.safe_files import KINDS

PNG = b"\x89PNG\r\n\x1a\n" + bytes(64)


def checkpoint_bytes() -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": {"w": torch.zeros(3)}}, buffer)
    return buffer.getvalue()


def other_kind(kind: str) -> bytes:
    """A file that is not of ``kind``: a checkpoint for a PNG output, a PNG for any other."""
    return checkpoint_bytes() if kind == "png" else PNG


# The flags a mode's command line names its outputs with, and what else the command needs (no model file is
# read: every one of these refusals comes while the request is built).
COMMAND = {
    "train": ["--mode", "train", "--dataset", "digits", "--overwrite"],
    "distill": ["--mode", "distill", "--model_path", "teacher.pt", "--overwrite"],
    "train_autoencoder": ["--mode", "train_autoencoder", "--dataset", "digits", "--overwrite"],
    "sample": ["--mode", "sample", "--model_path", "m.pt"],
    "evaluate": ["--mode", "evaluate", "--model_path", "m.pt"],
    "benchmark": ["--mode", "benchmark", "--device", "cpu"],
    "export": ["--mode", "export", "--model_path", "m.pt", "--format", "onnx"],
}
FLAG_OUTPUTS = [(mode, flag) for mode, table in OUTPUTS.items() for flag in table if flag[2:] in FLAGS]
OTHER_OUTPUTS = [(mode, name) for mode, table in OUTPUTS.items() for name in table if name[2:] not in FLAGS]


def request(tmp_path, mode: str, *args: str):
    import os

    previous = os.getcwd()
    os.chdir(tmp_path)
    try:
        return resolve.request_for(parser.parse_args(["--device", "cpu", *COMMAND[mode], *args]))
    finally:
        os.chdir(previous)


@pytest.mark.parametrize("mode,flag", FLAG_OUTPUTS)
def test_every_output_flag_refuses_a_name_of_another_kind(tmp_path, mode, flag):
    kind = kinds_of(mode, fmt="onnx")[flag]
    wrong = "out.png" if kind != "png" else "out.json"
    with pytest.raises(ValueError, match=rf"{flag}.*(ending in|must name a \.pt)"):
        request(tmp_path, mode, flag, wrong)
    assert not (tmp_path / wrong).exists()


@pytest.mark.parametrize("mode,flag", FLAG_OUTPUTS)
def test_every_output_flag_leaves_an_existing_file_of_another_kind_alone(tmp_path, mode, flag):
    kind = kinds_of(mode, fmt="onnx")[flag]
    target = tmp_path / f"out{KINDS[kind].suffixes[0]}"
    target.write_bytes(other_kind(kind))
    before = target.read_bytes()
    with pytest.raises(ValueError, match=rf"{flag} {target.name} already holds .*, not {KINDS[kind].name}"):
        request(tmp_path, mode, flag, target.name)
    assert target.read_bytes() == before


@pytest.mark.parametrize("mode,name", OTHER_OUTPUTS)
def test_every_derived_output_is_held_to_its_kind(tmp_path, mode, name):
    kind = kinds_of(mode, fmt="onnx")[name]
    target = tmp_path / f"derived{KINDS[kind].suffixes[0]}"
    with pytest.raises(ValueError, match="ending in"):
        check_mode_outputs(mode, {name: tmp_path / "derived.txt"}, fmt="onnx")
    target.write_bytes(other_kind(kind))
    with pytest.raises(ValueError, match="already holds"):
        check_mode_outputs(mode, {name: target}, fmt="onnx")
    target.write_bytes(b"")  # an empty file has nothing to lose
    check_mode_outputs(mode, {name: target}, fmt="onnx")


def test_a_benchmark_report_never_replaces_a_checkpoint(tmp_path):
    # The reported loss: --json t.pt turned a 28 MB checkpoint into a JSON file, and exited 0.
    checkpoint = checkpoint_bytes()
    for flag, name in (("--json", "t.json"), ("--csv", "t.csv"), ("--chart", "t.png")):
        (tmp_path / "t.pt").write_bytes(checkpoint)
        (tmp_path / name).write_bytes(checkpoint)
        with pytest.raises(ValueError, match=f"{flag} writes .* ending in"):
            request(tmp_path, "benchmark", flag, "t.pt")
        with pytest.raises(ValueError, match=f"{flag} {name} already holds a PyTorch checkpoint"):
            request(tmp_path, "benchmark", flag, name)
        assert (tmp_path / "t.pt").read_bytes() == (tmp_path / name).read_bytes() == checkpoint


def test_an_output_of_the_same_kind_is_accepted(tmp_path):
    (tmp_path / "old.json").write_text('{"rows": []}')
    (tmp_path / "old.csv").write_text("row,median_s\n")
    (tmp_path / "old.png").write_bytes(PNG)
    request(tmp_path, "benchmark", "--json", "old.json", "--csv", "old.csv", "--chart", "old.png")
    (tmp_path / "old.pt").write_bytes(checkpoint_bytes())
    request(tmp_path, "train", "--model_path", "old.pt")


def test_every_mode_has_its_outputs_in_the_table():
    from ddpm.cli.reads import MODES

    assert set(OUTPUTS) == set(MODES)
    with pytest.raises(KeyError):  # an output no table lists is a programming error, not a silent pass
        check_mode_outputs("sample", {"--json": "x.json"})


@pytest.mark.parametrize(
    "mode,args,message",
    [
        (
            "distill",
            ["--model_path", "t_diff", "--output", "t_diff/student.pt"],
            "--output t_diff/student.pt is inside",
        ),
        (
            "distill",
            ["--model_path", "t_diff", "--output", "s.pt", "--log_dir", "t_diff/logs"],
            "metrics.csv is inside",
        ),
        ("sample", ["--model_path", "t_diff", "--output", "t_diff/grid.png"], "--output t_diff/grid.png is inside"),
        (
            "sample",
            ["--model_path", "t_diff", "--save_npz", "t_diff/sub/x.npz"],
            "--save_npz t_diff/sub/x.npz is inside",
        ),
        ("evaluate", ["--model_path", "t_diff", "--json", "t_diff/q.json"], "--json t_diff/q.json is inside"),
        ("export", ["--model_path", "t_diff", "--output", "t_diff/m.onnx"], "--output t_diff/m.onnx is inside"),
        ("train", ["--dataset", "folder", "--data_dir", "imgs", "--model_path", "imgs/m.pt"], "--data_dir reads"),
        ("train_autoencoder", ["--dataset", "folder", "--data_dir", "imgs", "--model_path", "imgs/a.pt"], "--data_dir"),
    ],
)
def test_no_output_is_written_inside_an_input_folder(tmp_path, mode, args, message):
    # t_diff stands for a diffusers model folder (only its name is read here); imgs for a folder of images, which
    # the reader walks with every sub-folder: what a run wrote there would be read as a model part or an image.
    (tmp_path / "t_diff").mkdir()
    (tmp_path / "imgs").mkdir()
    with pytest.raises(ValueError, match=message):
        request(tmp_path, mode, *args)
    assert sorted(p.name for p in (tmp_path / "t_diff").iterdir()) == []


def test_a_training_runs_curves_inside_its_image_folder_are_refused_before_the_images_are_read(tmp_path):
    (tmp_path / "imgs").mkdir()
    with pytest.raises(
        ValueError, match="--log_dir's metrics.csv imgs/logs/metrics.csv is inside the folder --data_dir"
    ):
        request(tmp_path, "train", "--dataset", "folder", "--data_dir", "imgs", "--log_dir", "imgs/logs")


@pytest.mark.parametrize(
    "mode,args",
    [
        ("sample", ["--model_path", "t_diff", "--profile", "t_diff/traces"]),
        ("distill", ["--model_path", "t_diff", "--output", "s.pt", "--profile", "t_diff/traces"]),
        ("train", ["--dataset", "folder", "--data_dir", "imgs", "--profile", "imgs/traces"]),
    ],
)
def test_profile_traces_are_never_written_inside_an_input_folder(tmp_path, mode, args):
    (tmp_path / "t_diff").mkdir()
    (tmp_path / "imgs").mkdir()
    with pytest.raises(ValueError, match="--profile .*/traces is inside the folder"):
        request(tmp_path, mode, *args)


# ----- derived outputs: the previews' folder beside the checkpoint, checked with the checkpoint --------------------
@pytest.mark.parametrize(
    "mode,args,message",
    [
        (
            "train",
            ["--dataset", "folder", "--data_dir", "m_samples", "--model_path", "m.pt"],
            "the training previews of --model_path m.pt go into m_samples, inside the folder --data_dir reads",
        ),
        (
            "train",
            ["--dataset", "folder", "--data_dir", "imgs", "--model_path", "link.pt"],  # link_samples -> imgs
            "the training previews of --model_path link.pt go into link_samples, inside the folder --data_dir reads",
        ),
        (
            "train",
            ["--init_from", "m_samples", "--model_path", "m.pt"],
            "go into m_samples, inside the folder --init_from reads",
        ),
        (
            "distill",
            ["--model_path", "s_samples", "--output", "s.pt"],
            "the training previews of --output s.pt go into s_samples, inside the folder --model_path reads",
        ),
        (
            "distill",
            ["--model_path", "m_samples", "--sampling_steps", "2"],  # the default --output: m_samples_student2.pt
            "--output m_samples_student2.pt go into m_samples_student2_samples, inside the folder --model_path",
        ),
    ],
)
def test_the_previews_folder_is_never_an_input_folder_and_is_refused_before_anything_is_read(
    tmp_path, mode, args, message
):
    """Found by the adversarial pass: <model stem>_samples/ was checked against no input, so a --data_dir, a
    diffusers teacher or an --init_from folder of that name gained a preview PNG each --sample_every (the next run
    trained on them). The folder is derived from the checkpoint's name and checked with it, while the request is
    built: before any data or model is read."""
    for name in ("m_samples", "s_samples", "imgs"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.png").write_bytes(PNG)
    (tmp_path / "link_samples").symlink_to("imgs")
    (tmp_path / "m_samples_student2_samples").symlink_to("m_samples")
    with pytest.raises(ValueError, match=message):
        request(tmp_path, mode, *args)
    for name in ("m_samples", "s_samples", "imgs"):
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["a.png"]


@pytest.mark.parametrize("mode,flag", [("train", "--model_path"), ("distill", "--output")])
def test_a_file_where_the_previews_folder_goes_is_refused_before_anything_is_read(tmp_path, mode, flag):
    """It was refused only after the dataset was loaded and the model built."""
    (tmp_path / "t_diff").mkdir()
    (tmp_path / "m_samples").write_bytes(PNG)
    args = ["--model_path", "t_diff", "--output", "m.pt"] if mode == "distill" else ["--model_path", "m.pt"]
    with pytest.raises(ValueError, match=f"the training previews of {flag} m.pt go into m_samples, which is a file"):
        request(tmp_path, mode, *args)
    assert (tmp_path / "m_samples").read_bytes() == PNG


def test_training_into_a_data_folder_named_like_its_previews_ends_in_one_line_and_adds_nothing(tmp_path):
    """The user's view of the class above: exit code 2, one line, no traceback, the images as they were, no
    checkpoint (run_here: main.main in this process)."""
    data = tmp_path / "m_samples"
    data.mkdir()
    for i in range(4):
        Image.new("L", (8, 8), color=i * 60).save(data / f"img{i}.png")
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    result = run_here(
        "--mode", "train", "--dataset", "folder", "--data_dir", "m_samples", "--img_size", "8", "--channels", "1",
        "--max_steps", "1", "--batch_size", "4", "--sample_every", "1", "--model_path", "m.pt", cwd=tmp_path,
    )  # fmt: skip
    assert_user_error(result, "the training previews of --model_path m.pt go into m_samples")
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before and not (tmp_path / "m.pt").exists()


def test_a_latent_exports_decoder_beside_it_is_checked_before_the_model_is_read(tmp_path):
    """X.decoder.onnx, derived from --output, was checked only once the model and its autoencoder were loaded; with
    --autoencoder given the model is a latent one, and its decoder's path is checked with --output, before the model
    file is read (m.pt is junk here: read, it would be called corrupt)."""
    (tmp_path / "m.pt").write_bytes(b"junk, never read")
    (tmp_path / "ae.pt").write_bytes(checkpoint_bytes())
    (tmp_path / "t.decoder.onnx").symlink_to("ae.pt")
    result = run_here(
        "--mode", "export", "--format", "onnx", "--model_path", "m.pt", "--autoencoder", "ae.pt", "--output", "t.onnx",
        cwd=tmp_path,
    )  # fmt: skip
    assert_user_error(result, "--output's decoder t.decoder.onnx is the same file as --autoencoder")
    assert (tmp_path / "ae.pt").read_bytes() == checkpoint_bytes() and not (tmp_path / "t.onnx").exists()
