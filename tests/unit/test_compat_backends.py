"""compat/backends.py: what a backend can do here, as facts, and why a CP examination cannot run."""

from __future__ import annotations


def test_unsupported_reason_says_when_a_backend_is_not_cp_registered_either():
    """_native_efficient in 0.39.0 and 0.42.1: registered without supports_context_parallel, and on a CPU its SDPA
    call finds no kernel. Both facts are said; a CP-registered backend that does not run gets only the first."""
    from cpdoctor.compat.backends import BackendFacts
    from cpdoctor.errors import UnsupportedKind

    efficient = BackendFacts("_native_efficient", registered=True, cp_registered=False, run_error="RuntimeError: No viable backend")
    reason = efficient.unsupported(2)
    assert reason.kind is UnsupportedKind.DOES_NOT_RUN
    assert reason.message.startswith("_native_efficient does not run here: RuntimeError: No viable backend")
    assert "nor is _native_efficient registered for context parallelism" in reason.message
    flash = BackendFacts("_native_flash", registered=True, cp_registered=True, run_error="RuntimeError: no CUDA")
    assert "context parallelism" not in flash.unsupported(2).message
    runs = BackendFacts("cpdoctor_cpu", registered=True, cp_registered=True, runs_here=True, returns_lse=True, has_backward=True)
    assert runs.unsupported(2) is None
    no_lse = BackendFacts(
        "native", registered=True, cp_registered=True, routes_cp=True, runs_here=True, returns_lse=False, has_backward=True
    )
    assert no_lse.unsupported(2).kind is UnsupportedKind.NO_LSE and no_lse.unsupported(1) is None
    local = BackendFacts("_native_math", registered=True, runs_here=True, has_backward=True)
    assert local.unsupported(2) is None and local.unsupported(2, model_level=True).kind is UnsupportedKind.NOT_CP_CAPABLE
