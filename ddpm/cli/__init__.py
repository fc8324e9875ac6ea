"""The command line: the flag table (flags.py; the training group in training_flags.py, the modes and who
reads what in reads.py), the per-mode parsers made from it (parser.py), and the flags' resolution into one
typed request per mode (resolve.py; the requests live in ddpm/requests.py, below the modes that receive them).
"""
