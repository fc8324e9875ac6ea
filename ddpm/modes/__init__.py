"""One module per --mode (train, train_autoencoder, sample, evaluate, export, benchmark), each with one
entry function taking its request; drawing.py is what sample and evaluate share.
"""
