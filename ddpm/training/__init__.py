"""Training: the DDPM trainer, the autoencoder's trainer, and the timestep samplers."""
