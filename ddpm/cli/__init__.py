"""The command line: the flags (parser.py), their resolution into one typed request (resolve.py), and
the requests the modes receive (requests.py).
"""
