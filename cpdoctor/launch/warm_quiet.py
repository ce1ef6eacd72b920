"""Imported first, and only, in the fork server warm ranks start from (warm.py): its stdout and stderr go to
/dev/null. The server inherits the command's terminal; what importing torch and diffusers prints there (a
deprecation warning) must not land in the user's terminal or in a `--json -` document. Each rank points both at
its own log file as soon as it is forked."""

import os

_devnull = os.open(os.devnull, os.O_WRONLY)
os.dup2(_devnull, 1)
os.dup2(_devnull, 2)
os.close(_devnull)
