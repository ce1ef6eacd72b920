"""The one state owner that needs a real process group: `launch/torchrun.py`'s HELD, armed, filled by a job's
group, used by the next job, released, twice in one process (the other owners: tests/unit/test_state_owners.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

SCRIPT = r"""
import json

import torch.distributed as dist

from cpdoctor.launch.jobs import Case, CaseNumbers, Job, RankResult
from cpdoctor.launch.torchrun import HELD, run_in_this_process
from cpdoctor.report import Environment


class Echo:
    def run_rank(self, case, ctx):
        return RankResult()

    def evaluate(self, case, results, ctx):
        numbers = CaseNumbers()
        numbers.environment = Environment()
        return numbers


def run() -> bool:
    result = run_in_this_process(Job(Echo(), (Case("x"),), "cpu", 60.0))
    return all(o.completed for o in result.outcomes) and len(result.outcomes) == 1


seen = {"unarmed": [run(), dist.is_initialized(), HELD.context is None]}
for entry in ("first", "second"):
    HELD.arm()
    ran = run()
    kept, world = HELD.context, dist.group.WORLD
    joined = run()  # a later job joins the kept group and leaves it alone
    same = dist.is_initialized() and dist.group.WORLD is world and HELD.context is kept
    HELD.release()
    seen[entry] = [ran, kept is not None and kept.owns_group, joined, same, dist.is_initialized(), HELD.context, HELD.armed]
print(json.dumps(seen))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_held_group_entered_twice_in_one_process():
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    env.pop("CPDOCTOR_SPAWNED", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["unarmed"] == [True, False, True]  # not armed: the job destroys the group it made
    for entry in ("first", "second"):
        # ran, kept its own group, a second job ran in it without destroying it; released: no group, disarmed
        assert seen[entry] == [True, True, True, True, False, None, False], (entry, seen[entry])
