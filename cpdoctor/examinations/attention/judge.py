"""From numbers to findings: tolerances, verdicts, diagnoses and remedies.

The tolerance of a tensor is `2 × e_base + eps(dtype)`, where `e_base` is the relative L2 error the same
backend makes on the full sequence *without* CP in the same dtype (measured in the same run) and eps is the
dtype's machine epsilon: the criterion flash-attn's own tests use (at most twice the error of a plain
same-dtype implementation). Measured on CPU: fp32 baselines are 3.7e-7–4.6e-7, so fp32 tolerates ~1e-6
(about 8 ulp, never 100× round-off); bf16 baselines are 2.2e-3–3.9e-3, so bf16 tolerates ~1.5e-2, while the
unrotated-mask bug shows 7.4e-2. Without a baseline (the backend has no local path) it is `4 × eps`.
"""

from __future__ import annotations

from typing import Any

from cpdoctor.report import TENSOR_LABELS, ExitCode, Finding, Verdict, overall

PASS, FAIL, CRASH, HANG, UNSUPPORTED = Verdict.PASS, Verdict.FAIL, Verdict.CRASH, Verdict.HANG, Verdict.UNSUPPORTED
EPS = {"fp32": 2.0**-23, "bf16": 2.0**-7, "fp16": 2.0**-10}
GRADS_FAR_WORSE = 10.0
"""A gradient whose error is this many times the forward's is wrong for a reason of its own."""

EXIT_OK, EXIT_FOUND, EXIT_BAD_INPUT, EXIT_CANNOT_EXAMINE = ExitCode.OK, ExitCode.FOUND, ExitCode.BAD_INPUT, ExitCode.CANNOT_EXAMINE


def tolerance(dtype: str, baseline: float | None) -> float:
    eps = EPS[dtype]
    return 4 * eps if baseline is None else 2 * baseline + eps




def _ranks_phrase(bad_ranks: list[int], world: int) -> str:
    if len(bad_ranks) == world:
        return f"on all {world} ranks"
    return f"only on rank{'s' if len(bad_ranks) > 1 else ''} {', '.join(map(str, bad_ranks))} of {world}"


def judge_tensors(tensors: dict[str, dict], dtype: str) -> dict[str, dict]:
    """Add tolerance, the ranks outside it and a per-tensor verdict to each tensor's numbers."""
    judged = {}
    for name, t in tensors.items():
        tol = tolerance(dtype, t.get("baseline_rel_err"))
        bad = [r for r, e in enumerate(t["per_rank_rel_err"]) if not e <= tol]
        ok = t["rel_err"] <= tol and t["nonfinite"] == 0 and not bad
        judged[name] = {**t, "tolerance": tol, "bad_ranks": bad, "verdict": PASS if ok else FAIL}
    return judged


def diagnose_attention(req: dict, facts: dict, tensors: dict[str, dict]) -> tuple[str, str]:
    """(diagnosis, remedy) naming the signature seen: forward vs backward, which of dQ/dK/dV, one rank vs
    all, ring vs Ulysses, degree 2 vs ≥ 3."""
    ring, ulysses, world = req["ring"], req["ulysses"], req["ring"] * req["ulysses"]
    backend = facts.get("name", req["backend"])
    bad = {n for n, t in tensors.items() if t["verdict"] == FAIL}
    if not bad:
        return (f"out, dQ, dK and dV match the full-sequence reference on every rank within the {req['dtype']} tolerance", "")
    layout = "ring" if ulysses == 1 else ("Ulysses" if ring == 1 else "the ring inside unified ring × Ulysses")
    all_bad_ranks = sorted({r for n in bad for r in tensors[n]["bad_ranks"]})
    where = _ranks_phrase(all_bad_ranks, world)
    parts: list[str] = []
    remedies: list[str] = []
    out_err = tensors["out"]["rel_err"]
    nonfinite = sum(t["nonfinite"] for t in tensors.values())
    if nonfinite:
        parts.append(f"{nonfinite} non-finite values (NaN/Inf) {where}")
        remedies.append("check the backend's dtype support; try --dtype fp32 to separate overflow from a CP defect")
    if "out" in bad:
        if facts.get("routes_cp") is False:
            parts.append(
                f"forward wrong {where} (out rel err {out_err:.2g}): {backend} ignores the parallel config and attends "
                f"only to each rank's local 1/{world} of the keys"
                + ("" if facts.get("cp_registered") else "; it is not registered as CP-capable and dispatch_attention_fn never checks")
            )
            remedies.append("use a CP-capable backend (`cpdoctor env` lists them; on CPU cpdoctor_cpu, on GPU _native_flash, _native_cudnn or flash)")
        elif req.get("mask_pad") and ring > 1:
            parts.append(
                f"forward wrong {where} only with a padding mask (out rel err {out_err:.2g}): {layout} applies each rank's "
                "local key mask to every rotated KV chunk instead of rotating the mask with its keys"
            )
            remedies += ["cpdoctor.patch() (its ring rotates the mask with the keys)", "Ulysses-only CP (it all-gathers the mask)"]
        else:
            parts.append(f"forward wrong {where} through {layout} (out rel err {out_err:.2g})")
            remedies.append("cpdoctor.patch() if the ring is involved; otherwise report it with `cpdoctor env --markdown`")
    grads_bad = [n for n in ("dq", "dk", "dv") if n in bad and ("out" not in bad or tensors[n]["rel_err"] > GRADS_FAR_WORSE * max(out_err, 1e-30))]
    if grads_bad and facts.get("routes_cp") is not False:
        labels = "/".join(TENSOR_LABELS[n] for n in grads_bad)
        errs = ", ".join(f"{TENSOR_LABELS[n]} {tensors[n]['rel_err']:.2g}" for n in grads_bad)
        fwd = "forward exact, " if "out" not in bad else ""
        if "dq" not in grads_bad and ring >= 3:
            parts.append(
                f"{fwd}backward wrong {where}: dQ exact and {labels} wrong ({errs}) at ring degree {ring} ≥ 3 through {layout}: "
                "the dK/dV accumulator travels the wrong way round the ring (to rank r+1 instead of r−1); "
                "the two directions agree only at ring 2"
            )
            remedies += ["cpdoctor.patch()", "keep ring_degree ≤ 2 and scale with Ulysses"]
        elif "dq" in grads_bad and ring > 1:
            parts.append(
                f"{fwd}backward wrong {where}: {labels} wrong ({errs}) through {layout}: the ring backward recomputes every "
                "ring step against stale iteration-0 (local) K/V and partial out/lse instead of the rotated chunk"
            )
            remedies += [
                "cpdoctor.patch()",
                "upgrade diffusers to a release whose ring backward passes the rotated key/value (then re-check ring ≥ 3)",
                "Ulysses-only CP",
            ]
        else:
            parts.append(f"{fwd}backward wrong {where}: {labels} wrong ({errs}) through {layout}")
            remedies.append("cpdoctor.patch() if the ring is involved; otherwise report it with `cpdoctor env --markdown`")
    diagnosis = "; ".join(parts) if parts else f"{', '.join(sorted(bad))} outside tolerance {where}"
    unique: dict[str, str] = {}
    for r in remedies:  # one entry per remedy, the first (most specific) wording kept
        unique.setdefault(r.split(" (")[0], r)
    remedy = "; or ".join(unique.values())
    return diagnosis, remedy


def attention_finding(req: dict, evaluated: dict) -> Finding:
    """The finding for one evaluated attention case."""
    probe = describe_attention(req, evaluated.get("backend", req["backend"]))
    facts = evaluated.get("facts", {})
    if "unsupported" in evaluated:
        return Finding(probe, UNSUPPORTED, evaluated["unsupported"], _unsupported_remedy(evaluated["unsupported"]), details={"facts": facts})
    tensors = judge_tensors(evaluated["tensors"], req["dtype"])
    diagnosis, remedy = diagnose_attention(req, facts, tensors)
    verdict = PASS if all(t["verdict"] == PASS for t in tensors.values()) else FAIL
    details = {"facts": facts}
    if "baseline_error" in evaluated:
        details["baseline_error"] = evaluated["baseline_error"]
    return Finding(probe, verdict, diagnosis, remedy, tensors, details)


def _unsupported_remedy(reason: str) -> str:
    if "install" in reason:
        return "install the missing package, or pick another backend (`cpdoctor env` lists what runs here)"
    if "LSE" in reason:
        return "use a backend with an LSE for ring attention (cpdoctor_cpu on CPU; _native_flash, _native_cudnn or flash on GPU), or Ulysses-only CP"
    return "pick a backend that runs on this device (`cpdoctor env` lists them)"


def describe_attention(req: dict, backend: str) -> str:
    return (
        f"attention ring={req['ring']} ulysses={req['ulysses']} backend={backend} {req['dtype']} "
        f"B{req['batch']} S{req['seq']} H{req['heads']} D{req['head_dim']}"
        + (f" mask_pad={req['mask_pad']}" if req.get("mask_pad") else "")
    )


def failure_findings(probe: str, failures: list[Any], timeout_s: float) -> list[Finding]:
    """CRASH / HANG findings from the launcher's rank failures, each with that rank's traceback."""
    crashed = [f for f in failures if f.kind == "CRASH"]
    hung = [f for f in failures if f.kind == "HANG"]
    findings = []
    if crashed:
        first, later = crashed[0], crashed[1:]
        stopped = [f.rank for f in failures if f.kind == "STOPPED"]
        tail = f"; then rank {', '.join(str(f.rank) for f in later)} failed too" if later else ""
        tail += f"; rank {', '.join(map(str, stopped))} was waiting in a collective and was stopped" if stopped else ""
        findings.append(
            Finding(
                probe,
                CRASH,
                f"rank {first.rank} raised: {first.message}{tail}",
                "read the traceback below; an AssertionError about divisibility means an uneven sequence shard (`cpdoctor plan`)",
                details={"tracebacks": {str(f.rank): f.traceback for f in crashed}},
            )
        )
    if hung:
        findings.append(
            Finding(
                probe,
                HANG,
                f"rank {', '.join(str(f.rank) for f in hung)} did not finish within {timeout_s:g} s",
                "a rank is stuck in a collective its peers never entered; raise --timeout if the machine is just slow",
                details={"logs": {str(f.rank): f.traceback for f in hung}},
            )
        )
    return findings

