"""`cpdoctor env`: what this machine and this diffusers can do for context parallelism, in one process.

The parts, each a plain function of the machine (nothing here prints):

- `facts`: the environment, one small function per fact; a fact that cannot be gathered reads "could not
  collect" instead of raising (in the manner of torch/utils/collect_env.py).
- `backend_table`: one row per attention backend registered in the installed diffusers (cpdoctor's
  `cpdoctor_cpu` included), found by trying each on tiny tensors and calling its CP ops as Ulysses does in
  training.
- `code_facts` gathers what the installed code does (ring template, dispatch, uneven-length modes) and
  `findings` turns those facts and the rows into findings through tables of rules, each with a diagnosis, a
  remedy and, where more than one process is needed to settle it, the `cpdoctor check` command that measures
  it. Nothing is decided from a version number.

`run(request)` puts them together into the `cpdoctor.report.Report` every examination returns; the backend rows
are its `backends` key.
"""

from __future__ import annotations

import importlib.util
import time

from cpdoctor.compat.diffusers import quiet
from cpdoctor.errors import BadInput
from cpdoctor.examinations.env import findings as rules
from cpdoctor.examinations.env.common import one_thread
from cpdoctor.examinations.env.facts import collect, collect_environment, ring_class
from cpdoctor.examinations.env.request import EnvRequest, resolve_device, resolve_dtype
from cpdoctor.report import Report
from cpdoctor.report.environment import AttentionBackend, Environment, Launch

EMULATED = (
    "CUDA kernels of the GPU backends emulated on CPU by cpdoctor's stand-ins: examined the installed diffusers' "
    "ops around them; not examined: the CUDA kernels themselves"
)
"""What `cpdoctor env --emulate` examined and what it did not (the environment's `emulated`)."""


def run(request: EnvRequest) -> Report:
    """The whole `cpdoctor env` examination in this process. BadInput (exit 2) without torch or a diffusers with
    CP (a missing required package, as errors.py has it); CannotExamine (exit 3) for --device cuda without a GPU.
    With `emulate`, the CUDA backends' ops run here on cpdoctor's kernel stand-ins, so their capabilities (LSE,
    backward, saved LSE, RNG advance) are found by running them, not only on meta."""
    from cpdoctor.examinations.env.backend_table import examine_row
    from cpdoctor.examinations.env.code_facts import gather

    t0 = time.perf_counter()
    request = request.validate()
    device, dtype, emulate = request.device, request.dtype, request.emulate
    if importlib.util.find_spec("torch") is None:
        raise BadInput("torch is not installed; pip install torch")
    if emulate:
        from cpdoctor.cpu_kernels import standins

        standins.activate()  # before diffusers is imported: it looks for flash-attn at import time
    dev = resolve_device(device)
    dtype_name = resolve_dtype(dtype, dev, emulate)
    software = collect_environment().software
    from cpdoctor.compat import diffusers as compat
    from cpdoctor.cpu_kernels import cpu_backend

    compat.dispatch_module()  # BadInput (exit 2) when diffusers, or its CP support, is missing
    probed = AttentionBackend(probe_device=str(dev), probe_dtype=dtype_name, ring_class=collect(ring_class))
    environment = Environment(software, Launch(emulated=EMULATED if emulate else None), probed)
    cpu_backend.register()
    config = compat.meshless_parallel_config(ring=1, ulysses=2, device=dev)
    with quiet(), one_thread():
        rows = [examine_row(name, dev, dtype_name, config) for name in compat.registered_backend_names()]
        code = gather(rows, dev, dtype_name, config)
    findings = rules.judge(code, rows, dtype_name)
    from cpdoctor.peer_impls.installed import installed_peers

    peers = tuple(installed_peers())
    return Report.of(findings, environment, request, wall_s=time.perf_counter() - t0, backends=tuple(rows), peers=peers)
