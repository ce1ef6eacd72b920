"""From the numbers of a model examination to a finding: verdict, diagnosis, remedy.

The same tolerance as the op level (`verdict.tolerance`: 2 × the no-CP error of the same model in the same
dtype + eps): for the gathered output, and for all parameter gradients concatenated into one vector. The
worst parameter is the one furthest outside its own tolerance (its own no-CP error); it is reported, and it
decides nothing on its own (see WORST_PARAM_SLACK). The diagnosis names forward vs backward, the op-level
check at the same layout (and the exact `cpdoctor check` command that reproduces it), and the padding mask.
"""

from __future__ import annotations

from typing import Any

from cpdoctor.examinations.attention.judge import (
    FAIL,
    GRADS_FAR_WORSE,
    PASS,
    UNSUPPORTED,
    Finding,
    attention_finding,
    failure_findings,
    tolerance,
)

MODEL_LABELS = {"out": "out", "grads": "all grads", "worst_param": "worst param"}

WORST_PARAM_SLACK = 10.0
"""The worst single parameter fails the examination only when it is this many times outside its own
tolerance: one parameter out of hundreds lands past 2 × its rounding noise by chance, a CP defect puts it
orders of magnitude past (0.39.0 tiny Flux ring 2: 3.27 against ~1e-7)."""


def describe_model(req: dict, backend: str | None = None, model: dict | None = None) -> str:
    model = model or {}
    name = model.get("short_name") or req["model"]
    source = model.get("source")
    source = "" if source is None else (" tiny" if source == "tiny config" else f" from {source}")
    frames = f"x{req['frames']}f" if req.get("frames") else ""
    return (
        f"model {name}{source} ring={req['ring']} ulysses={req['ulysses']} backend={backend or req['backend']} "
        f"{req['dtype']} {req.get('height')}x{req.get('width')}{frames} text {req.get('text_len')} B{req['batch']}"
        + (f" mask_pad={req['mask_pad']}" if req.get("mask_pad") else "")
    )


def check_command(req: dict, mask: bool = False) -> str:
    """The `cpdoctor check` command that runs the op-level cross-check of this layout."""
    parts = ["cpdoctor check"]
    if req["ring"] != 1 or req["ulysses"] == 1:
        parts.append(f"--ring {req['ring']}")
    if req["ulysses"] != 1:
        parts.append(f"--ulysses {req['ulysses']}")
    if req["dtype"] != "fp32":
        parts.append(f"--dtype {req['dtype']}")
    if req["backend"] != "auto":
        parts.append(f"--backend {req['backend']}")
    if mask and req.get("mask_pad"):
        parts.append(f"--mask-pad {req['mask_pad']}")
    return " ".join(parts)


def _judge(row: dict, dtype: str) -> dict:
    tol = tolerance(dtype, row.get("baseline_rel_err"))
    bad = [r for r, e in enumerate(row.get("per_rank_rel_err") or []) if not e <= tol]
    ok = row["rel_err"] <= tol and row["nonfinite"] == 0 and not bad
    return {**row, "tolerance": tol, "bad_ranks": bad, "verdict": PASS if ok else FAIL}


def worst_param(params: dict[str, dict], dtype: str) -> dict | None:
    """The parameter furthest outside its own tolerance, as a tensor row (None when there are none)."""
    if not params:
        return None

    def ratio(item: tuple[str, dict]) -> float:
        p = item[1]
        if p["nonfinite"]:
            return float("inf")
        return p["rel_err"] / tolerance(dtype, p.get("baseline_rel_err"))

    name, p = max(params.items(), key=ratio)
    tol = tolerance(dtype, p.get("baseline_rel_err"))
    row = {
        "param": name,
        "rel_err": p["rel_err"],
        "max_abs": p["max_abs"],
        "nonfinite": p["nonfinite"],
        "numel": p["numel"],
        "worst_rank": None,
        "per_rank_rel_err": [],
        "baseline_rel_err": p.get("baseline_rel_err"),
        "tolerance": tol,
        "bad_ranks": [],
    }
    ok = p["nonfinite"] == 0 and p["rel_err"] <= WORST_PARAM_SLACK * tol
    row["verdict"] = PASS if ok else FAIL
    return row


def judge_model_tensors(evaluated: dict, dtype: str) -> dict[str, dict]:
    tensors = {name: _judge(row, dtype) for name, row in evaluated["tensors"].items()}
    worst = worst_param(evaluated.get("params", {}), dtype)
    if worst is not None:
        tensors["worst_param"] = worst
    return tensors


def _op_findings(req: dict, evaluated: dict) -> list[tuple[dict, Finding | None, str | None]]:
    """(op request, its finding or None, error or None) for each op-level cross-check."""
    out = []
    for item in evaluated.get("op_level", []):
        if "evaluated" in item:
            out.append((item["request"], attention_finding(item["request"], item["evaluated"]), None))
        else:
            out.append((item["request"], None, item.get("error", "not run")))
    return out


def _bad_tensors(finding: Finding) -> str:
    labels = {"out": "out", "dq": "dQ", "dk": "dK", "dv": "dV"}
    return ", ".join(f"{labels.get(n, n)} {t['rel_err']:.2g}" for n, t in finding.tensors.items() if t["verdict"] == FAIL)


def diagnose_model(req: dict, evaluated: dict, tensors: dict[str, dict]) -> tuple[str, str]:
    """(diagnosis, remedy): forward vs backward, the op level at the same layout, the mask."""
    ring, ulysses = req["ring"], req["ulysses"]
    layout = "ring" if ulysses == 1 else ("Ulysses" if ring == 1 else "ring × Ulysses")
    model = evaluated.get("model", {})
    n_params = model.get("parameter_tensors")
    out, grads, worst = tensors["out"], tensors["grads"], tensors.get("worst_param")
    grads_bad = grads["verdict"] == FAIL or (worst is not None and worst["verdict"] == FAIL)
    ops = _op_findings(req, evaluated)
    plain = next(((r, f, e) for r, f, e in ops if not r.get("mask_pad")), None)
    masked = next(((r, f, e) for r, f, e in ops if r.get("mask_pad")), None)
    worst_txt = (
        f"; worst parameter {worst['param']} {worst['rel_err']:.2g} (no-CP {_fmt(worst['baseline_rel_err'])})" if worst else ""
    )
    if out["verdict"] == PASS and not grads_bad:
        params = f"all {n_params} parameter gradients" if n_params else "the parameter gradients"
        return (
            f"output and {params} match the single-process fp64 model within the {req['dtype']} tolerance through "
            f"enable_parallelism ({layout}, {req['ring'] * req['ulysses']} ranks)"
            f" (out {out['rel_err']:.2g}, all grads {grads['rel_err']:.2g}{worst_txt})",
            "",
        )
    parts: list[str] = []
    remedies: list[str] = []
    if out["nonfinite"] or grads["nonfinite"]:
        parts.append(f"{out['nonfinite'] + grads['nonfinite']} non-finite values (NaN/Inf)")
        remedies.append("try --dtype fp32 to separate overflow from a CP defect")
    if out["verdict"] == FAIL:
        what = f"forward wrong: out rel err {out['rel_err']:.2g} (tolerance {out['tolerance']:.2g})"
        if grads_bad:
            cause = "and the gradients with it" if grads["rel_err"] <= GRADS_FAR_WORSE * max(out["rel_err"], 1e-30) else (
                "and the gradients far worse, a backward defect of their own"
            )
            what += f", {cause} (all grads {grads['rel_err']:.2g}{worst_txt})"
        parts.append(what)
    else:
        parts.append(f"forward exact (out {out['rel_err']:.2g}), backward wrong: all parameter grads {grads['rel_err']:.2g} (tolerance {grads['tolerance']:.2g}){worst_txt}")
    # the mask
    if req.get("mask_pad"):
        if masked is not None and masked[1] is not None and plain is not None and plain[1] is not None:
            mf, pf = masked[1], plain[1]
            mask_out_bad = mf.tensors.get("out", {}).get("verdict") == FAIL
            plain_out_bad = pf.tensors.get("out", {}).get("verdict") == FAIL
            if mask_out_bad and not plain_out_bad:
                parts.append(
                    f"the text padding mask is involved: at op level the same layout is exact in forward without a mask and "
                    f"wrong with one (`{check_command(req, mask=True)}`: {_bad_tensors(mf)}): {layout} applies each rank's "
                    "local key mask to every rotated KV chunk instead of rotating the mask with its keys"
                )
                remedies += ["cpdoctor.patch() (its ring rotates the mask with the keys)", "Ulysses-only CP (it all-gathers the mask)"]
            elif not mask_out_bad:
                parts.append(f"the padding mask is handled at op level (`{check_command(req, mask=True)}` passes the forward)")
        elif ring > 1:
            parts.append("the text padding mask is split under ring attention: rerun without --mask-pad to see whether it is involved")
    # the op level at the same layout
    if plain is not None:
        _, pf, err = plain
        cmd = check_command(req)
        if pf is None:
            parts.append(f"the op-level cross-check did not run ({err}); run `{cmd}`")
        elif pf.verdict == FAIL:
            parts.append(f"the attention op alone fails at this layout: `{cmd}` → {_bad_tensors(pf)} ({pf.diagnosis})")
            if pf.remedy:
                remedies.append(pf.remedy)
        elif pf.verdict == PASS:
            if not (req.get("mask_pad") and masked is not None and masked[1] is not None and masked[1].verdict == FAIL):
                parts.append(
                    f"the attention op alone passes at this layout (`{cmd}`): the defect lies in the model's CP path around "
                    "attention (its _cp_plan splits and gathers, rotary embeddings, masks), not in the attention op"
                )
                remedies.append("compare the model's _cp_plan with its forward (`cpdoctor plan` lists what it splits); report it with `cpdoctor env --markdown`")
        else:
            parts.append(f"the op-level cross-check `{cmd}` says {pf.verdict}: {pf.diagnosis}")
    unique: dict[str, str] = {}
    for r in remedies:
        for piece in r.split("; or "):
            unique.setdefault(piece.split(" (")[0], piece)
    return "; ".join(parts), "; or ".join(unique.values())


def _fmt(x: Any) -> str:
    return "–" if x is None else f"{x:.2g}"


def model_finding(req: dict, evaluated: dict) -> Finding:
    """The finding for one evaluated model case."""
    probe = describe_model(req, evaluated.get("backend"), evaluated.get("model"))
    facts = evaluated.get("facts", {})
    if "unsupported" in evaluated:
        reason = evaluated["unsupported"]
        if "LSE" in reason:
            remedy = "use a backend with an LSE for ring attention (cpdoctor_cpu on CPU; _native_flash, _native_cudnn or flash on GPU), or Ulysses-only CP"
        elif "context-parallel capable" in reason:
            remedy = "use a CP-capable backend (`cpdoctor env` lists them; on CPU cpdoctor_cpu, on GPU _native_flash, _native_cudnn or flash)"
        else:
            remedy = "pick a backend that runs on this device (`cpdoctor env` lists them)"
        return Finding(probe, UNSUPPORTED, reason, remedy, details={"facts": facts})
    tensors = judge_model_tensors(evaluated, req["dtype"])
    diagnosis, remedy = diagnose_model(req, evaluated, tensors)
    verdict = PASS if all(t["verdict"] == PASS for t in tensors.values()) else FAIL
    details: dict[str, Any] = {"facts": facts, "model": evaluated.get("model", {})}
    params = evaluated.get("params", {})
    if params:
        ranked = sorted(params.items(), key=lambda kv: kv[1]["rel_err"], reverse=True)
        details["worst_params"] = {n: {"rel_err": p["rel_err"], "baseline_rel_err": p.get("baseline_rel_err")} for n, p in ranked[:5]}
    ops = []
    for r, f, err in _op_findings(req, evaluated):
        entry: dict[str, Any] = {"command": check_command(req, mask=bool(r.get("mask_pad")))}
        if f is not None:
            entry.update(verdict=f.verdict, diagnosis=f.diagnosis, rel_err={n: t["rel_err"] for n, t in f.tensors.items()})
        else:
            entry["error"] = err
        ops.append(entry)
    details["op_level"] = ops
    if "baseline_error" in evaluated:
        details["baseline_error"] = evaluated["baseline_error"]
    return Finding(probe, verdict, diagnosis, remedy, tensors, details)


def model_case_findings(item: dict, timeout_s: float) -> list[Finding]:
    """Findings of one launched case: the evaluated finding, or CRASH / HANG from the ranks that stopped."""
    from cpdoctor import launch

    req = item["case"]["request"]
    if "evaluated" in item:
        return [model_finding(req, item["evaluated"])]
    stopped = launch.failures_from_payloads(item["rank_payloads"])
    return model_failure_findings(req, stopped.failures, timeout_s)


def model_failure_findings(req: dict, failures: list[Any], timeout_s: float) -> list[Finding]:
    findings = failure_findings(describe_model(req), failures, timeout_s)
    if any("warning_once" in f.message for f in failures):
        for f in findings:
            f.remedy = (
                "diffusers' CP hook calls logger.warning_once, which only exists once transformers is imported (it patches "
                "logging.Logger; every pipeline imports it): pip install transformers and import it before enable_parallelism. "
                "The warning it wanted to give: an input of the _cp_plan has another rank than expected and is not split"
            )
    return findings
