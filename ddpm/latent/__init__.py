"""Latent diffusion: the autoencoder (the first stage) and the link between a latent U-Net and it."""
