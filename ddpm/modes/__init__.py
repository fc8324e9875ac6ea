"""One module per --mode (train, sample, evaluate, export, benchmark, distill), each with one entry function
taking its request; train.py also runs train_autoencoder and holds the run every training mode shares.
"""
