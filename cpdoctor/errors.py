"""The two ways an examination can refuse to start, shared by the CLI, the API and the probes.

Both carry a one-line message meant for the user verbatim; the CLI maps them to exit codes
(BadInput -> 2, CannotExamine -> 3) and never shows a traceback for them.
"""


class BadInput(Exception):
    """The request or the install is wrong (degrees, shapes, names, files, a missing required package such as
    diffusers): exit code 2."""


class CannotExamine(Exception):
    """The request is fine but nothing of it can be examined here (e.g. --device cuda without a GPU, a model
    family without an input builder): exit code 3. A backend whose optional package is missing is not this:
    it is an UNSUPPORTED finding (also exit 3 when it is the only one)."""
