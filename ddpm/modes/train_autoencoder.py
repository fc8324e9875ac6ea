"""--mode train_autoencoder: the first stage of a latent model (training/autoencoder_trainer.py).

python main.py --mode train_autoencoder --dataset digits
python main.py --mode train --dataset digits --autoencoder checkpoints/digits_autoencoder.pt
"""

from __future__ import annotations

from pathlib import Path

from ddpm.requests import AutoencoderTrainRequest
from ddpm.training.autoencoder_trainer import train_autoencoder
from ddpm.util import interrupts
from ddpm.util.safe_files import run_lock


def run_train_autoencoder(request: AutoencoderTrainRequest) -> None:
    """The first stage of a latent model; an existing checkpoint is replaced only with --overwrite."""
    with run_lock(request.checkpoint):  # a second run on this path is refused until this one ends
        if Path(request.checkpoint).exists() and not request.overwrite:
            raise ValueError(
                f"--model_path {request.checkpoint} already holds a checkpoint; pass --overwrite to start over and "
                "replace it"
            )
        try:
            train_autoencoder(request)
        except interrupts.Interrupted as stop:  # what was trained is saved and said (training/autoencoder_trainer.py)
            raise SystemExit(stop.exit_code) from None
