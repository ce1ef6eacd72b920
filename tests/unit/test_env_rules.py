"""`cpdoctor env`'s rules on facts fed by hand: no process group, no diffusers, no torch op.

The facts are what `code_facts` and `backend_table` gather from the installed code; here each combination is
written out, and the verdicts, the wording and the commands are read back.
"""

from __future__ import annotations

import pytest

from cpdoctor.compat.backends import BackendFacts
from cpdoctor.examinations.env import findings as rules
from cpdoctor.examinations.env.backend_table import BackendRow, Cell, OpProbe, judge_cells, kernel_flags, requirement_hint
from cpdoctor.examinations.env.facts import NOT_COLLECTED, collect
from cpdoctor.examinations.env.findings import CodeFacts, DispatchTrial, RingSource
from cpdoctor.examinations.env.request import EnvRequest
from cpdoctor.report import Environment, ExitCode, Report, Verdict, overall

UNIFIED = ["TemplatedRingAttention", "_templated_unified_attention"]
RING_0_39 = RingSource(passes_tensors=False, sends_to_next=True, gathers_mask=False, callers=UNIFIED)
"""The ring template of diffusers 0.39.0 (docs/FACTS.md): stale K/V backward, dK/dV to r+1, local mask."""
RING_FIXED = RingSource(passes_tensors=True, sends_to_next=False, gathers_mask=True, callers=UNIFIED)
OK = Cell(True)


def by_probe(findings):
    return {f.subject: f for f in findings}


def facts(name: str = "b", **given: object) -> BackendFacts:
    """A backend's facts as compat.backends finds them (registered; the rest as given)."""
    return BackendFacts(name, registered=True, **given)  # type: ignore[arg-type]


def row(name="b", *, facts_=None, accepts=True, op=None, ring=OK, ulysses=OK, training=OK) -> BackendRow:
    f = facts(name, runs_here=True, cp_registered=True, routes_cp=True, returns_lse=True) if facts_ is None else facts_
    return BackendRow(name, f, accepts, op, ring, ulysses, training)


def clean_op(**kw) -> OpProbe:
    base = dict(
        measured_on="cpu",
        saved_lse=True,
        grad_shapes_ok=True,
        grad_shapes=[[1, 16, 2, 32]] * 3,
        rel_err={"out": 1e-7, "dq": 2e-7, "dk": 2e-7, "dv": 2e-7},
        tolerance=1e-6,
        rng_advanced=False,
    )
    base.update(kw)
    return OpProbe(**base)


# ------------------------------------------------------------------------------------------------ ring template


def test_ring_source_of_0_39_is_three_fails():
    found = by_probe(rules.ring_findings(RING_0_39))
    assert [f.verdict for f in found.values()] == [Verdict.FAIL] * 3
    stale = found["ring backward: rotated K/V"]
    assert stale.diagnosis.startswith("the installed code calls `ctx.backward_op(ctx, grad_out)`")
    assert ", in ring × Ulysses too (it goes through the same class)" in stale.diagnosis
    assert stale.command == "cpdoctor check --ring 2" and stale.remedy.startswith("cpdoctor.patch()")
    direction = found["ring backward: dK/dV direction"]
    assert direction.diagnosis.endswith("; today it hides behind the stale K/V defect above and remains once that is fixed")
    assert direction.command == "cpdoctor check --ring 3"
    assert found["ring forward: mask rotation"].command == "cpdoctor check --ring 2 --mask-pad 3"


def test_ring_source_fixed_is_three_passes_and_patched_wording():
    found = rules.ring_findings(RING_FIXED)
    assert [(f.subject, f.verdict) for f in found] == [
        ("ring backward: rotated K/V", Verdict.PASS),
        ("ring backward: dK/dV direction", Verdict.PASS),
        ("ring forward: mask rotation", Verdict.PASS),
    ]
    assert found[2].diagnosis == "the installed code gathers the attention mask with the keys"
    patched = rules.ring_findings(RingSource(patched=True, passes_tensors=True, sends_to_next=True, gathers_mask=True))
    direction = by_probe(patched)["ring backward: dK/dV direction"]
    assert direction.verdict is Verdict.FAIL
    assert direction.diagnosis.startswith("the installed code (replaced in this process by cpdoctor's patch) sends")
    assert "ring × Ulysses" not in direction.diagnosis and "hides behind" not in direction.diagnosis


def test_unreadable_and_absent_ring_are_warnings_that_say_measure_it():
    found = rules.ring_findings(RingSource())
    assert [(f.verdict, f.remedy) for f in found] == [(Verdict.WARN, "measure it")] * 3
    assert [f.command for f in found] == ["cpdoctor check --ring 2", "cpdoctor check --ring 3", "cpdoctor check --ring 2 --mask-pad 3"]
    absent = rules.ring_findings(RingSource(absent=True))
    assert [(f.subject, f.verdict) for f in absent] == [("ring template", Verdict.WARN)]


# ------------------------------------------------------------------------------------------------ dispatch


@pytest.mark.parametrize(
    "trial, verdict, words, command",
    [
        (DispatchTrial(), Verdict.INFO, "no backend that is not registered for CP runs here", None),
        (DispatchTrial(["m"], [], "m", "ValueError: parallel config given to m"), Verdict.PASS, "refuses a parallel config for m", None),
        (
            DispatchTrial(["m"], [], "m", "RuntimeError: boom"),
            Verdict.INFO,
            "raised RuntimeError: boom",
            "cpdoctor check --ring 2 --backend m",
        ),
        (
            DispatchTrial(["m"], ["f"], "m", None),
            Verdict.WARN,
            "Backends here that would do this: m (accept the parallel config and ignore it); f (do not accept it: dispatch drops it);",
            "cpdoctor check --ring 2 --backend m",
        ),
    ],
)
def test_dispatch_rules(trial, verdict, words, command):
    f = rules.dispatch_finding(trial)
    assert f.subject == "dispatch: CP check" and f.verdict is verdict and words in f.diagnosis and f.command == command


def test_dispatch_warning_keeps_its_details():
    f = rules.dispatch_finding(DispatchTrial(["_native_math"], [], "_native_math", None))
    assert f.details() == {"tried": "_native_math", "ignores_config": ["_native_math"], "drops_config": []}
    assert f.remedy.startswith("choose a CP-capable backend")


# ------------------------------------------------------------------------------------------------ ops


def test_cudnn_on_meta_without_lse_is_a_fail_with_a_bf16_command():
    op = OpProbe(measured_on="meta", lse_not_requested=True, grad_shapes_ok=True, kernel_args={"aten.x": [{"compute_log_sumexp": False}]})
    no_kernel = Cell(False, "no kernel for this device")
    found = by_probe(rules.op_findings([row("_native_cudnn", op=op, ring=no_kernel, ulysses=no_kernel, training=no_kernel)], "fp32"))
    lse = found["_native_cudnn: LSE for backward"]
    assert lse.verdict is Verdict.FAIL and "asks its kernel not to compute the LSE (compute_log_sumexp=False)" in lse.diagnosis
    assert lse.diagnosis.endswith("measured on the meta device, as this device has no kernel for it: shapes and kernel arguments only")
    assert lse.command == "cpdoctor check --ulysses 2 --backend _native_cudnn --dtype bf16"
    assert lse.details() == {"kernel_args": {"aten.x": [{"compute_log_sumexp": False}]}}
    assert "_native_cudnn: backward" not in found  # the LSE finding says it; the grads have the right shape
    # measured on meta only: nothing passes here, and no backend can do CP on this device
    assert "CP ops on this device" not in found and found["CP backends here"].verdict is Verdict.WARN


def test_backward_in_kernel_layout_says_so():
    op = OpProbe(measured_on="meta", grad_shapes_ok=False, grad_shapes=[[1, 16, 2, 32], [1, 2, 16, 32], [1, 2, 16, 32]])
    f = by_probe(rules.op_findings([row("_native_flash", op=op)], "fp32"))["_native_flash: backward"]
    assert f.verdict is Verdict.FAIL
    assert "returns dK, dV of shape [1, 2, 16, 32], the kernel layout (B, H, S, D) for q/k/v of shape [1, 16, 2, 32]" in f.diagnosis
    assert f.remedy.startswith("cpdoctor.patch() for ring layouts")  # whether the fix has a kernel is not known
    fused = OpProbe(measured_on="meta", grad_shapes_ok=False, grad_shapes=op.grad_shapes, fix_calls_kernel=True)
    f = by_probe(rules.op_findings([row("_native_flash", op=fused)], "fp32"))["_native_flash: backward"]
    assert f.remedy.startswith("cpdoctor.patch() (its ring and Ulysses call the kernel directly and never these ops)")


def test_wrong_numbers_and_rng_advance():
    op = clean_op(rel_err={"out": 1e-7, "dq": 0.5, "dk": 1e-7, "dv": 1e-7}, rng_advanced=True)
    found = by_probe(rules.op_findings([row("flash", op=op, training=Cell(False, "wrong"))], "bf16"))
    assert found["flash: backward"].diagnosis == (
        "flash's ops disagree with an fp64 reference on one process (out 1e-07, dq 0.5, dk 1e-07, dv 1e-07; "
        "tolerance 1e-06); measured on cpu in bf16"
    )
    assert found["flash: RNG"].verdict is Verdict.WARN and "advanced the device generator" in found["flash: RNG"].diagnosis
    forced = by_probe(rules.op_findings([row("flash", op=clean_op(forced_dropout=1e-30))], "bf16"))["flash: RNG"]
    assert "gave its kernel dropout_p=1e-30 (the generator will advance)" in forced.diagnosis
    assert "CP ops on this device" not in found


def test_clean_ops_pass_and_no_cp_backend_warns():
    found = rules.op_findings([row("cpdoctor_cpu", op=clean_op()), row("native", op=clean_op(saved_lse=False))], "fp32")
    assert [(f.subject, f.verdict) for f in found] == [("CP ops on this device", Verdict.PASS)]
    assert found[0].diagnosis.startswith("cpdoctor_cpu, native: the forward saves what the backward needs")
    nothing = rules.op_findings([row("flash", ulysses=Cell(False, "not installed"))], "fp32")
    assert [(f.subject, f.verdict) for f in nothing] == [("CP backends here", Verdict.WARN)]


# ------------------------------------------------------------------------------------------------ table cells


def test_cells_of_a_backend_that_is_not_installed_or_not_registered():
    cells = judge_cells(facts(requirement_error="flash_attn is not available. Please install `flash-attn>=2.6.3`."), False, None)
    assert cells == (Cell(False, "not installed: install `flash-attn>=2.6.3`"),) * 3
    math = judge_cells(facts(runs_here=True, cp_registered=False, routes_cp=False), True, None)
    assert math[0] == Cell(False, "not registered for CP (enable_parallelism refuses it); accepts a parallel config and ignores it")
    assert requirement_hint("Something broke. Details follow") == "Something broke"


def test_cells_of_native_and_of_a_backward_that_reads_a_missing_lse():
    native = facts(runs_here=True, cp_registered=True, routes_cp=True, returns_lse=False)
    ring, ulysses, training = judge_cells(native, True, clean_op(saved_lse=False))
    assert ring == Cell(False, "no LSE: the ring needs one to merge KV blocks") and ulysses == OK and training == OK
    _, _, training = judge_cells(native, True, clean_op(lse_not_requested=True))
    assert training == Cell(False, "its forward saves no LSE unless asked, and its backward needs one")
    _, _, training = judge_cells(native, True, clean_op(rel_err={"out": 0.0, "dq": 0.3}, tolerance=1e-6))
    assert training == Cell(False, "backward wrong: rel err 0.3 > tolerance 1e-06")


def test_kernel_flags_from_recorded_arguments():
    fwd = {"aten._scaled_dot_product_cudnn_attention": [{"compute_log_sumexp": False, "dropout_p": 0.0}]}
    both = {**fwd, "aten.bwd": [{"dropout_p": 1e-30}]}
    assert kernel_flags(fwd, both) == (True, 1e-30)
    assert kernel_flags({}, {}) == (None, None)
    assert kernel_flags({"k": [{"compute_log_sumexp": True}]}, {}) == (False, None)


# ------------------------------------------------------------------------------------------------ the rest, and the verdict


def test_default_backend_and_uneven_modes():
    assert rules.default_backend_finding(None, []) is None
    missing = rules.default_backend_finding("nope", [row("native")])
    assert (
        missing.verdict is Verdict.WARN and missing.diagnosis == "DIFFUSERS_ATTN_BACKEND=nope is not a backend of the installed diffusers"
    )
    native = row("native", ring=Cell(False, "no LSE"))
    assert (
        rules.default_backend_finding("native", [native]).diagnosis
        == "DIFFUSERS_ATTN_BACKEND=native does Ulysses here but not everything: no LSE"
    )
    assert rules.default_backend_finding("b", [row("b")]).verdict is Verdict.PASS
    none = rules.uneven_finding({})
    assert none.verdict is Verdict.INFO and none.remedy == "" and none.command == "cpdoctor plan MODEL --ring R --ulysses U"
    both = rules.uneven_finding({"ulysses_anything": True, "ring_anything": None})
    assert both.diagnosis.startswith(
        "ContextParallelConfig has ulysses_anything (inference only: its backward raises NotImplementedError), "
        "ring_anything (no class found):"
    )
    assert both.details() == {"modes": ["ulysses_anything", "ring_anything"]}


def _report(code: CodeFacts, rows: list[BackendRow]) -> Report:
    return Report.of(rules.judge(code, rows, "fp32"), Environment(), EnvRequest())


def test_a_0_39_install_fails_with_exit_1():
    code = CodeFacts(RING_0_39, DispatchTrial(["_native_math"], [], "_native_math", None), {}, None)
    report = _report(code, [row("cpdoctor_cpu", op=clean_op())])
    assert (report.verdict, report.exit_code) == (Verdict.FAIL, ExitCode.FOUND)
    assert [f.subject for f in report.findings] == [
        "ring backward: rotated K/V",
        "ring backward: dK/dV direction",
        "ring forward: mask rotation",
        "dispatch: CP check",
        "CP ops on this device",
        "uneven sequence lengths",
    ]
    assert report.to_dict()["findings"][0]["command"] == "cpdoctor check --ring 2"


def test_a_fixed_install_with_a_refusing_dispatch_passes_with_exit_0():
    code = CodeFacts(RING_FIXED, DispatchTrial(["m"], [], "m", "ValueError: parallel"), {"ring_anything": True}, "cpdoctor_cpu")
    report = _report(code, [row("cpdoctor_cpu", op=clean_op())])
    assert {f.verdict for f in report.findings} == {Verdict.PASS, Verdict.INFO}
    assert (report.verdict, report.exit_code) == (Verdict.PASS, ExitCode.OK)
    # a warning alone does not fail the run
    warned = rules.judge(CodeFacts(RING_FIXED, DispatchTrial(["m"], [], "m", None), {}), [row(op=clean_op())], "fp32")
    assert overall(warned) == (Verdict.WARN, ExitCode.OK)


def test_a_fact_that_cannot_be_collected_reads_so():
    def broken():
        raise RuntimeError("no driver")

    assert collect(broken) == NOT_COLLECTED == "could not collect"
    assert collect(lambda: "2.13.0") == "2.13.0"
