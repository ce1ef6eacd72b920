"""The two ways an examination can refuse to start, shared by the CLI, the API and the probes.

Both carry a one-line message meant for the user verbatim; the CLI maps them to exit codes
(BadInput -> 2, CannotExamine -> 3) and never shows a traceback for them.
"""


class BadInput(Exception):
    """The request itself is wrong (degrees, shapes, names, files): exit code 2."""


class CannotExamine(Exception):
    """The request is fine but this machine cannot run it (missing package, no device): exit code 3."""
