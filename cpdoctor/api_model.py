"""`check_model`: CP parity of a real diffusers model class, output and parameter gradients, as a `Report`.

    import cpdoctor
    report = cpdoctor.check_model(model="flux", ring=2)          # tiny Flux, 2 ranks
    report = cpdoctor.check_model(model="/ckpt/transformer", ring=2, ulysses=2, dtype="bf16")

The parent resolves the model and fills the shapes first (it imports diffusers: unknown names, a missing tiny
config or safetensors, a text mask the model does not take and uneven top-level shards are bad input before
any process starts), then launches the ranks through the same `run_cases` as `check_attention`.
"""

from __future__ import annotations

from typing import Any, Callable

from cpdoctor.api import DEFAULT_TIMEOUT_S, build_request, default_degrees, examine
from cpdoctor.errors import BadInput
from cpdoctor.examinations.model.request import ModelRequest
from cpdoctor.report import Report


def build_model_request(**fields: Any) -> ModelRequest:
    """A ModelRequest from keyword fields (None = default); ring defaults to 2, or 1 when only ulysses is given."""
    fields = default_degrees({k: v for k, v in fields.items() if v is not None})
    return ModelRequest.from_dict(fields).validate()


def op_level_cases(req: ModelRequest) -> list[dict]:
    """The op-level cross-checks run at the same layout: exactly what `cpdoctor check --ring R --ulysses U
    [--dtype D] [--backend B]` runs, and again with `--mask-pad N` when the model's text is padded."""
    common = dict(ring=req.ring, ulysses=req.ulysses, backend=req.backend, dtype=req.dtype, device=req.device)
    cases = [{"request": build_request(**common).to_dict()}]
    if req.mask_pad:
        cases.append({"request": build_request(**common, mask_pad=req.mask_pad).to_dict()})
    return cases


def prepare_request(request: ModelRequest | None = None, **fields: Any) -> ModelRequest:
    """Validate, resolve the model and fill the default shapes (imports diffusers; BadInput on bad input)."""
    from cpdoctor.examinations.model import probe

    req = request.validate() if request is not None else build_model_request(**fields)
    try:
        prepared, _ = probe.prepare(req)
    except ImportError as exc:  # torch or diffusers missing
        raise BadInput(f"missing package: {exc}") from exc
    return prepared


def check_model(
    request: ModelRequest | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    on_tick: Callable[[], None] | None = None,
    **fields: Any,
) -> Report:
    """Model-level CP parity of a diffusers model class through its own `enable_parallelism`: the gathered
    output and every parameter gradient (summed over the CP group) against the same model in one process in
    fp64; with `patch=True`, before and after cpdoctor's fixed ring. Under torchrun every rank returns the
    same report (rank 0's)."""
    from cpdoctor.examinations.model.judge import model_case_findings, model_failure_findings

    req = prepare_request(request, **fields)
    ops = op_level_cases(req)
    cases = [{"request": req.to_dict(), "patched": False, "op_cases": ops}]
    if req.patch:
        cases.append({"request": req.to_dict(), "patched": True, "op_cases": ops})
    return examine(
        "model",
        req,
        cases,
        timeout_s,
        lambda failures: model_failure_findings(req.to_dict(), failures, timeout_s),
        lambda item: model_case_findings(item, timeout_s),
        on_tick,
    )
