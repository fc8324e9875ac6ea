"""util/file_kinds.py: each kind of file this tool writes is told apart by its first bytes (and a zip's names), so
an output replaces only a file of its own kind; and util/estimates.py's line before a long phase."""

from __future__ import annotations

import importlib.util
import io
import json

import numpy as np
import pytest
import torch
from helpers import TINY_TRAIN, assert_user_error, run_here
from PIL import Image

from ddpm.util.estimates import phase_line, seconds_per_call
from ddpm.util.file_kinds import KINDS, check_kind, expected_kind, found_kind


def written(tmp_path, name: str, write) -> object:
    path = tmp_path / name
    write(path)
    return path


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")  # a TorchScript file to find
def test_each_kind_is_found_from_its_content(tmp_path):
    files = {
        "png": written(tmp_path, "a.png", lambda p: Image.new("L", (2, 2)).save(p)),
        "checkpoint": written(tmp_path, "a.pt", lambda p: torch.save({"w": torch.zeros(2)}, p)),
        "torchscript": written(tmp_path, "a.ts", lambda p: torch.jit.script(torch.nn.ReLU()).save(str(p))),
        "npz": written(tmp_path, "a.npz", lambda p: np.savez(p, images=np.zeros(3, np.uint8))),
        "json": written(tmp_path, "a.json", lambda p: p.write_text(json.dumps({"rows": []}, indent=2))),
        "text": written(tmp_path, "a.csv", lambda p: p.write_text("step,loss\n1,0.5\n")),
    }
    if importlib.util.find_spec("safetensors"):
        from safetensors.torch import save_file

        files["safetensors"] = written(tmp_path, "a.safetensors", lambda p: save_file({"w": torch.zeros(2)}, p))
    if importlib.util.find_spec("onnx"):
        from onnx import helper

        graph = helper.make_graph([], "g", [], [])
        files["onnx"] = written(
            tmp_path, "a.onnx", lambda p: p.write_bytes(helper.make_model(graph).SerializeToString())
        )
    for kind, path in files.items():
        assert found_kind(path) == kind, (kind, path)
        if kind in KINDS:
            assert expected_kind(path) == kind
            check_kind("--out", path, kind=kind)  # its own kind may be replaced
    assert found_kind(written(tmp_path, "empty.json", lambda p: p.write_bytes(b""))) is None
    assert found_kind(written(tmp_path, "blob.engine", lambda p: p.write_bytes(b"\x00\x01ftrt" * 8))) == "binary"
    check_kind("--output", tmp_path / "blob.engine", kind="tensorrt")  # engines have no magic of their own
    check_kind("--csv", files["text"], kind="csv")


def test_a_file_of_another_kind_is_refused_whatever_its_name(tmp_path):
    buffer = io.BytesIO()
    torch.save({"model": {}}, buffer)
    disguised = written(tmp_path, "report.json", lambda p: p.write_bytes(buffer.getvalue()))
    with pytest.raises(ValueError, match="report.json already holds a PyTorch checkpoint, not a JSON file"):
        check_kind("--json", disguised, kind="json")
    with pytest.raises(ValueError, match="already holds a PyTorch checkpoint"):  # no kind given: the name's
        check_kind("the preview", disguised, kind=None)
    with pytest.raises(ValueError, match="--csv writes a CSV table and needs a file name ending in .csv, got r.JSON"):
        check_kind("--csv", "r.JSON", kind="csv")
    json_file = written(tmp_path, "r.csv", lambda p: p.write_text('{"a": 1}'))
    with pytest.raises(ValueError, match="already holds a JSON file, not a CSV table"):
        check_kind("--csv", json_file, kind="csv")


def test_the_estimate_line_says_calls_time_and_memory():
    line = phase_line("calibration", calls=4096, seconds=80, held_bytes=3 << 20, available_bytes=20 << 30)
    assert line == "calibration: 4,096 U-Net calls, about 1 min 20 s; 3.0 MiB held, 20.0 GiB available"
    calls = []
    assert seconds_per_call(lambda: calls.append(1), device=torch.device("cpu")) >= 0 and len(calls) == 2


def test_a_checkpoint_cut_short_is_found_truncated_and_named_so(tmp_path):
    buffer = io.BytesIO()
    torch.save({"model": {"w": torch.zeros(2048)}}, buffer)
    cut = written(tmp_path, "student.pt", lambda p: p.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2]))
    assert found_kind(cut) == "broken_zip"
    with pytest.raises(ValueError, match="student.pt already holds a truncated or corrupt zip archive"):
        check_kind("--output", cut, kind="checkpoint")


@pytest.mark.parametrize(
    "content,held",
    [(b"\x89PNG\r\n\x1a\n" + bytes(8), "holds a PNG image"), (b"notes\n", "holds a text file"), (b"", "is empty")],
)
def test_resuming_a_file_that_is_no_checkpoint_names_what_it_holds(tmp_path, content, held):
    """--resume reads --model_path before it writes it: a PNG or a text file there is no checkpoint to continue, not
    an output that "would be destroyed"; the file stays as it was."""
    (tmp_path / "ck.pt").write_bytes(content)
    result = run_here(*TINY_TRAIN, "--resume", "--model_path", "ck.pt", cwd=tmp_path)
    assert_user_error(result, f"--model_path ck.pt is not a checkpoint (it {held}); --resume continues one")
    assert (tmp_path / "ck.pt").read_bytes() == content
