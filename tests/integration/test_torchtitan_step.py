"""`cpdoctor step examples/torchtitan_flux_step.py:FUNCTION --ring 2`: torchtitan's own FLUX training step
(`FluxTrainer.forward_backward_step`, unmodified) on CPU ranks, examined in two runs (without CP, then with CP).

Skipped where torchtitan is not installed (`pip install cpdoctor[titan]`, docs/TORCHTITAN.md). Every expectation
comes from the same example code run in one process inside this test, never typed in:
- the correct step PASSes (its image and text tokens are sharded by torchtitan, which is right);
- the input fault (each CP rank draws its own noise and timestep) FAILs naming exactly the inputs that differ when
  the step draws under each CP rank's seed in one process, on the ranks where they differ;
- the reduction fault (FSDP's mean over dp_shard × cp) FAILs with the factor between the one-process step's
  gradients under the two divisors the example sets at cp 2 and cp 1;
- torchtitan's own seeding (`FluxTrainer.__init__`'s `set_determinism`, distinct seeds over the `fsdp` mesh, which
  holds the CP ranks) FAILs naming the inputs that differ under the seeds it gives each CP rank (read with torch's
  fake process group, one simulated rank at a time).

The pieces the examination uses are checked on torchtitan's own inputs and mesh too (the example run by hand
under torchrun): `input_layouts` reads its token shards as contiguous shards of dim 1 and the rest as replicated,
and names exactly the inputs the one-process derivation finds drawn apart, on the ranks it finds; `degrees` reads
dp 2 × cp 2 from `parallel_dims.get_mesh("cp")`.

Not run in CI (its budget is over; torchtitan needs its own environment, docs/TORCHTITAN.md): README's "torch-native
CP trainers" gives the local command. The correct step and the reduction fault run at dp 1 × cp 2 and dp 2 × cp 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from titan_ranks import simulated_rank

pytest.importorskip("torchtitan.models.flux.trainer", reason="torchtitan is not installed (cpdoctor[titan])")
torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "torchtitan_flux_step.py"
CP = 2
LAYOUTS = [pytest.param(1, id="dp1xcp2"), pytest.param(2, id="dp2xcp2")]
"""The data-parallel degree of a test run at CP 2 (one CP group, or two)."""


def cpdoctor_step(function: str, dp: int = 1) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "cpdoctor", "step", f"{EXAMPLE}:{function}", "--ring", str(CP), "--dp", str(dp)]
    cmd += ["--json", "-", "--timeout", "240"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    data["exit"] = proc.returncode
    return data


@dataclass
class OneProcess:
    """The example's code in this process (a gloo world of one): the model's inputs under a given seed, the
    gradients under a given FSDP divisor."""

    example: object

    def _run(self, seed: int | None = None, divisor: float = 1.0) -> tuple[dict, dict]:
        from torch.distributed.fsdp import FSDPModule

        ex = self.example
        trainer, model, dims = ex.build(1, 1)
        for m in model.modules():
            if isinstance(m, FSDPModule):  # alone, FSDP makes no reduction: no PREMUL_SUM reaches gloo
                m.set_force_sum_reduction_for_comms(False)  # torch 2.13 divides twice at world size 1 with it on
                m.set_gradient_divide_factor(divisor)
        if seed is not None:
            torch.manual_seed(seed)
        seen: dict = {}
        hook = model.register_forward_pre_hook(
            lambda mod, args, kwargs: seen.update({k: v.detach().clone() for k, v in kwargs.items()}), with_kwargs=True
        )
        try:
            ex.run_step(trainer, dims)
        finally:
            hook.remove()
        return seen, ex.full_grads(model)

    def inputs(self, seed: int) -> dict:
        return self._run(seed=seed)[0]

    def grads(self, divisor: float) -> dict:
        return self._run(divisor=divisor)[1]

    def differing(self, seeds: list[int]) -> dict[str, set[int]]:
        """{input name: the CP ranks whose input differs from CP rank 0's} when each CP rank's step draws under
        its seed."""
        runs = [self.inputs(s) for s in seeds]
        out: dict[str, set[int]] = {}
        for name, first in runs[0].items():
            ranks = {r for r, run in enumerate(runs) if not torch.equal(run[name], first)}
            if ranks:
                out[name] = ranks
        return out


@pytest.fixture(scope="module")
def one_process():
    import torch.distributed as dist

    from cpdoctor.cpu_kernels import standins

    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    sys.path.insert(0, str(EXAMPLE.parent))
    import torchtitan_flux_step as example

    had_standins = standins.installed()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield OneProcess(example)
    finally:
        dist.destroy_process_group()
        if not had_standins:
            standins.uninstall()


def titan_seeds(example, cp: int) -> list[int]:
    """The seed torchtitan's `set_determinism` gives each CP rank of a dp-1 job, as `FluxTrainer.__init__` calls
    it, read one simulated rank at a time (the seed is given, so no peer is asked)."""
    from torchtitan.config import DebugConfig
    from torchtitan.distributed import utils as dist_utils

    seeds = []
    for r in range(cp):
        with simulated_rank(r, cp):
            dims = example.parallel_dims(cp, 1)
            dist_utils.set_determinism(
                dims, torch.device("cpu"), DebugConfig(seed=example.SEED), distinct_seed_mesh_dims=["fsdp", "dp_replicate"]
            )
            seeds.append(torch.initial_seed())
    return seeds


def _wrong_inputs(finding: dict) -> dict[str, set[int]]:
    return {name: set(ranks) for name, ranks in (finding.get("details") or {}).get("inputs_differ", {}).items()}


@pytest.mark.parametrize("dp", LAYOUTS)
def test_torchtitans_correct_step_passes(dp):
    report = cpdoctor_step("step", dp)
    assert report["exit"] == 0, report["findings"]
    assert len(report["findings"]) == dp  # one per CP group
    for f in report["findings"]:
        assert f["verdict"] == "PASS" and "the same step run without CP" in f["diagnosis"], f
        assert not _wrong_inputs(f)  # the image and text tokens are torchtitan's shards: right


def test_an_input_drawn_per_cp_rank_fails_naming_it_and_the_ranks(one_process):
    ex = one_process.example
    expected = one_process.differing([ex.step_seed(0, r, "input") for r in range(CP)])
    assert expected  # the noise and the timestep differ between CP ranks
    report = cpdoctor_step("step_input_fault")
    assert report["exit"] == 1
    (f,) = report["findings"]
    assert f["verdict"] == "FAIL", f
    assert _wrong_inputs(f) == expected, f
    for name in expected:
        assert name in f["diagnosis"], f


@pytest.mark.parametrize("dp", LAYOUTS)
def test_an_extra_average_over_cp_fails_with_its_factor(one_process, dp):
    from cpdoctor.examinations.step.watcher.full_grads import compare

    ex = one_process.example
    without_cp, with_cp = (one_process.grads(ex.fsdp_divisor(dp, cp, "reduction") / dp) for cp in (1, CP))
    factor = compare(with_cp, without_cp).factor  # FSDP's mean over dp_shard × cp against the run without CP's over dp
    assert factor != pytest.approx(1.0)
    report = cpdoctor_step("step_reduction_fault", dp)
    assert report["exit"] == 1
    assert len(report["findings"]) == dp
    for f in report["findings"]:
        assert f["verdict"] == "FAIL" and not _wrong_inputs(f), f
        assert f["details"]["factor"] == pytest.approx(factor, rel=1e-3), f


def test_torchtitans_own_seeding_fails_naming_what_the_cp_ranks_draw_apart(one_process):
    ex = one_process.example
    expected = one_process.differing(titan_seeds(ex, CP))
    assert set(expected) >= {"timesteps"}
    report = cpdoctor_step("step_titan_seeding")
    assert report["exit"] == 1
    (f,) = report["findings"]
    assert f["verdict"] == "FAIL" and _wrong_inputs(f) == expected, f


# -- the pieces the wiring will use, on torchtitan's own inputs and mesh (these pass today) -----------------------


def torchrun_example(prefix: Path, cp: int, dp: int, *args: str) -> list[dict]:
    """The example by hand under torchrun (no cpdoctor): every rank's model inputs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp * dp}", str(EXAMPLE)]
    cmd += ["--cp", str(cp), "--dp", str(dp), *args, "--inputs", str(prefix)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(f"{prefix}.rank{r}.pt") for r in range(cp * dp)]


@pytest.fixture(scope="module")
def by_hand(tmp_path_factory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("titan-inputs")
    return {
        "without": torchrun_example(tmp / "without", 1, 1)[0],
        "correct": torchrun_example(tmp / "correct", CP, 1),
        "input_fault": torchrun_example(tmp / "input", CP, 1, "--plant", "input"),
        "titan_without": torchrun_example(tmp / "titan-without", 1, 1, "--seeding", "torchtitan")[0],
        "titan": torchrun_example(tmp / "titan", CP, 1, "--seeding", "torchtitan"),
    }


def _judged(ranks_inputs: list[dict], full: dict) -> dict:
    from cpdoctor.examinations.step.judgment.input_layouts import classify_all, judge_inputs

    per_rank = [classify_all(inputs, full, CP, r) for r, inputs in enumerate(ranks_inputs)]
    return {g.name: g for g in judge_inputs(per_rank, tuple(range(CP)))}


def test_torchtitans_token_shards_are_read_as_shards_and_the_rest_as_replicated(by_hand):
    from cpdoctor.examinations.step.judgment.input_layouts import Placement
    from cpdoctor.peer_impls.layouts import Layout

    full = by_hand["without"]
    per_token = {n for n, v in full.items() if v.ndim == 3}  # (B, tokens, features): what cp_shard splits
    assert per_token and per_token != set(full)
    for name, group in _judged(by_hand["correct"], full).items():
        if name in per_token:
            assert group.placement is Placement.SHARD and group.dim == 1 and group.layout is Layout.CONTIGUOUS, group
        else:
            assert group.placement is Placement.REPLICATED, group


@pytest.mark.parametrize("case", ["input_fault", "titan"])
def test_inputs_drawn_per_cp_rank_are_named_with_their_ranks(by_hand, one_process, case):
    from cpdoctor.examinations.step.judgment.input_layouts import Placement

    ex = one_process.example
    seeds = [ex.step_seed(0, r, "input") for r in range(CP)] if case == "input_fault" else titan_seeds(ex, CP)
    expected = one_process.differing(seeds)
    full = by_hand["without" if case == "input_fault" else "titan_without"]
    judged = _judged(by_hand[case], full)
    wrong = {name: set(g.wrong_ranks) for name, g in judged.items() if g.placement is Placement.WRONG}
    assert wrong == expected


def test_degrees_from_torchtitans_own_cp_mesh(one_process):
    from cpdoctor.examinations.step.watcher.degrees import DegreeSource, consecutive_group, job_degrees

    ex = one_process.example
    for r in range(4):  # dp 2 × cp 2
        with simulated_rank(r, 4):
            dims = ex.parallel_dims(2, 2)
            d = job_degrees(rank=r, world=4, mesh=dims.get_mesh("cp"))
        assert (d.ring, d.ulysses, d.dp, d.source) == (2, 1, 2, DegreeSource.MESH)
        assert d.cp_ranks == consecutive_group(r, 2)


ONE_RUN = """
import sys
sys.path.insert(0, {folder!r})
import torchtitan_flux_step as ex


def one_run(watch_step):
    trainer, model, dims = ex.build(2, 1)
    with watch_step(model):
        open({marker!r}, "w").close()  # the step would run here
        ex.run_step(trainer, dims)
"""


def test_one_run_refuses_torchtitans_model_before_its_step_with_the_two_run_command(tmp_path):
    """A function that does not take its degrees runs once against a rebuilt copy, which a model that is not
    diffusers' cannot have: refused at the watch's entry, with the reason and the two-run command."""
    script, marker = tmp_path / "one_run.py", tmp_path / "stepped"
    script.write_text(ONE_RUN.format(folder=str(EXAMPLE.parent), marker=str(marker)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "cpdoctor", "step", f"{script}:one_run", "--nproc", "2", "--timeout", "240"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "FSDPFluxModel cannot be examined in one run" in proc.stderr, proc.stderr[-2000:]
    assert f"cpdoctor step {script}:one_run --ring 2" in " ".join(proc.stderr.split()), proc.stderr[-2000:]
    assert "enable_parallelism" not in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists()
