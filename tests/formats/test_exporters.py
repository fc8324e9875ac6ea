"""formats/exporters.py: every ONNX graph this tool writes (a U-Net's, a latent model's decoder's) goes through
one export that holds the graph to its I/O spec and runs onnx.checker, so a graph that does not match is never
written."""

import re

import pytest
import torch
from helpers import ROOT, needs_onnx

from ddpm.formats import exporters
from ddpm.formats.unet_io import DecoderIO

pytestmark = needs_onnx


def test_a_graph_that_does_not_match_its_spec_is_refused():
    io = DecoderIO(latent_shape=(2, 4, 4), image_shape=(1, 8, 8))
    wrong = torch.nn.Conv2d(2, 2, 1)  # (B, 2, 4, 4) out where the spec says (B, 1, 8, 8)
    with pytest.raises(RuntimeError, match=r"does not match its I/O spec \(.*images"):
        exporters.export_decoder_onnx(wrong, io=io)
    right = torch.nn.Sequential(torch.nn.Conv2d(2, 1, 1), torch.nn.Upsample(scale_factor=2))
    proto = exporters.export_decoder_onnx(right, io=io)
    assert exporters.onnx_io_mismatches(proto, io) == []


def test_the_onnx_exporter_is_called_in_one_place():
    calls = {
        path.relative_to(ROOT).as_posix(): len(re.findall(r"torch\.onnx\.export\(", path.read_text()))
        for path in (*ROOT.glob("*.py"), *(ROOT / "ddpm").rglob("*.py"))
    }
    assert {path: n for path, n in calls.items() if n} == {"ddpm/formats/exporters.py": 1}
