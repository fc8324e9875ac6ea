"""--mode train_autoencoder: the first stage of a latent model (training/autoencoder_trainer.py).

python main.py --mode train_autoencoder --dataset digits
python main.py --mode train --dataset digits --autoencoder checkpoints/digits_autoencoder.pt
"""

from __future__ import annotations

from ddpm.modes.training_run import training_run
from ddpm.requests import AutoencoderTrainRequest
from ddpm.training.autoencoder_trainer import train_autoencoder
from ddpm.util import messages


def run_train_autoencoder(request: AutoencoderTrainRequest) -> None:
    """The first stage of a latent model, in the run every training mode shares (modes/training_run.py): its own
    loop, no curves, and an existing checkpoint replaced only with --overwrite (there is no --resume)."""
    with training_run(request.checkpoint, flag="--model_path", overwrite=request.overwrite):
        try:
            train_autoencoder(request)
        except messages.Interrupted as stop:  # what was trained is saved and said (training/autoencoder_trainer.py)
            raise SystemExit(stop.exit_code) from None
