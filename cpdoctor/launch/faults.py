"""Injected faults, for the tests that prove a failing rank becomes a finding.

`CPDOCTOR_INJECT_FAULT=WHAT@RANK[:CASE]` makes rank RANK fail just before the examination's first collective:
WHAT is `raise`, `hang` (sleeps forever, never ticking), `exit` (exit code 17), `slow` (works for
`CPDOCTOR_FAULT_SLOW_S` seconds, default 10, ticking as it goes: a rank far slower than its peers, but moving)
or `stall` (goes on into the examination and sleeps forever at its first collective, before entering it: a rank
stopped inside the CP attention, outside any collective, while its peers wait in that collective, flight.py);
CASE, when given, limits it to the `unpatched` or `patched` cases (e.g. `raise@1:unpatched` crashes the stock
code's run and leaves the patched run alone).
"""

from __future__ import annotations

import os
import time

from cpdoctor.launch.flight import stall_at_first_collective
from cpdoctor.launch.progress import tick

FAULT_ENV = "CPDOCTOR_INJECT_FAULT"
SLOW_ENV = "CPDOCTOR_FAULT_SLOW_S"


def inject_fault(rank: int, case_label: str) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if "@" not in spec:
        return
    what, _, where = spec.partition("@")
    target, _, label = where.partition(":")
    if int(target) != rank or (label and label != case_label):
        return
    if what == "raise":
        raise RuntimeError(f"fault injected into rank {rank} by {FAULT_ENV}")
    if what == "hang":
        while True:
            time.sleep(3600)
    if what == "stall":
        stall_at_first_collective()
    if what == "exit":
        os._exit(17)
    if what == "slow":
        until = time.monotonic() + float(os.environ.get(SLOW_ENV, "10"))
        while time.monotonic() < until:
            time.sleep(0.2)
            tick("injected slow work")
