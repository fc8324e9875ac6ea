"""data/datasets.py's image folders, as docs/own_images.md describes them: every image file at any depth (its
suffix in any case), other files skipped, 32x32 RGB by default, each image center-cropped to a square before it
is resized."""

import torch
from PIL import Image

from ddpm.data.catalog import default_shape
from ddpm.data.datasets import load_images


def test_a_folder_is_read_at_any_depth_center_cropped_at_32x32_rgb_by_default(tmp_path):
    (tmp_path / "shapes" / "deep" / "deeper").mkdir(parents=True)
    wide = Image.new("RGB", (64, 32), (255, 0, 0))  # red margins, 16 pixels each side ...
    wide.paste((0, 255, 0), (16, 0, 48, 32))  # ... around a green 32x32 center
    wide.save(tmp_path / "shapes" / "wide.png")
    Image.new("RGB", (40, 40), (0, 0, 255)).save(tmp_path / "shapes" / "deep" / "deeper" / "BLUE.PNG")
    (tmp_path / "shapes" / "notes.txt").write_text("not an image")
    size, channels = default_shape("folder")
    assert (size, channels) == (32, 3)
    loaded = load_images("folder", data_dir=tmp_path, image_size=size)
    assert loaded.images.shape == (2, 3, 32, 32) and loaded.images.dtype == torch.uint8
    blue, green = loaded.images  # sorted by path: shapes/deep/deeper/BLUE.PNG, shapes/wide.png
    assert (blue[2] == 255).all() and (blue[:2] == 0).all()
    assert (green[1] == 255).all() and (green[0] == 0).all()  # the red margins were cropped away
    assert loaded.class_names == ("shapes",)  # every image lies under one first-level folder
    grey = load_images("folder", data_dir=tmp_path, image_size=16, channels=1).images
    assert grey.shape == (2, 1, 16, 16)
