"""`python -m cpdoctor.launch JOB OUTDIR`: the entry of one spawned rank."""

import os
import sys

from cpdoctor.launch.worker import worker_main

code = worker_main(sys.argv[1], sys.argv[2])
# everything a rank reports is in its files by now; leave without finalizing the interpreter, where a gloo worker
# thread still releasing the last collective's tensors aborts the process (docs/DECISIONS.md)
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
