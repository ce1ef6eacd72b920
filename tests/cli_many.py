"""Several `cpdoctor` command lines in one interpreter, each through the CLI's own entry (`cpdoctor.cli.main`, as the
console script calls it) with its own argv, its stdout, stderr and exit code captured apart.

For the tests of bad input, which ends in the parent before any rank starts: one interpreter importing diffusers
once answers them all (a fresh `cpdoctor` per case cost 5-7 s each on 2 cores, most of it that import).
Usage: python tests/cli_many.py '[["model", "fluxx", "--ring", "2"], ...]'  -> a JSON list as the last stdout line.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


def run_one(args: list[str]) -> dict:
    out, err = io.StringIO(), io.StringIO()
    sys.argv = ["cpdoctor", *args]
    code: object = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        from cpdoctor.cli import main

        try:
            main()
        except SystemExit as exc:
            code = exc.code
    code = code if isinstance(code, int) else (0 if code is None else 1)
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    results = [run_one(args) for args in json.loads(sys.argv[1])]
    sys.__stdout__.write("\n" + json.dumps(results) + "\n")
