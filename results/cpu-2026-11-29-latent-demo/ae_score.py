"""The judge on an autoencoder's reconstructions of the 1,000 held-out digits: a latent model's ceiling."""

import sys

import torch

sys.path.insert(0, "/work/main")
from ddpm.data.datasets import load_images
from ddpm.evaluation.quality import MnistJudge, to_signed
from ddpm.latent.autoencoder import load_autoencoder
from ddpm.training.autoencoder_trainer import reconstruct

judge = MnistJudge(image_size=28)
held8 = load_images("mnist_5k", data_dir=".", image_size=28, train=False).images
held = to_signed(held8)
print("held", judge.score(held, name="held"))
for path in sys.argv[1:]:
    loaded = load_autoencoder(path, device=torch.device("cpu"))
    with torch.no_grad():
        rec = to_signed(reconstruct(loaded.model, held8))
    print(path, judge.score(rec, name=path))
