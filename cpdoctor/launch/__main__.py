"""`python -m cpdoctor.launch JOB OUTDIR`: the entry of one spawned rank."""

import sys

from cpdoctor.launch.worker import worker_main

sys.exit(worker_main(sys.argv[1], sys.argv[2]))
