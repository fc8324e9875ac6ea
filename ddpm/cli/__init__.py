"""The command line: the flag table (flags.py), the per-mode parsers made from it (parser.py), and the
flags' resolution into one typed request per mode (resolve.py; the requests live in ddpm/requests.py,
below the modes that receive them).
"""
