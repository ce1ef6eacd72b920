"""`cpdoctor step --emulate MODE -- <command>`: an environment faked in every process of the launched command, where
CPU ranks differ from the GPU ranks the trainer is written for. Applied by the capture's `arm` (capture.py), right
after torch is imported and before the user's code runs; never an edit of the user's command or of the trainer's
logic; every finding of such a run says what was emulated (`emulation_note`)."""

from __future__ import annotations

from collections.abc import Iterable

NOTES = {
    "diffusers-cpu": (
        "diffusers' CP on CPU ranks (cpdoctor's --emulate diffusers-cpu): torch.accelerator.device_count() seen as 1 "
        "where it is 0 (some releases' enable_parallelism divide by it), cpdoctor's CPU attention backend registered as "
        "cpdoctor_cpu (no stock backend runs CP attention on CPU); the trainer's own code unchanged"
    ),
    "torchtitan-cpu": (
        "torchtitan on CPU ranks (cpdoctor's --emulate torchtitan-cpu): torch's device type seen as cpu, the 'fake' "
        "backend registered for size-1 mesh dims, FSDP2's reductions as sums (gloo has no PREMUL_SUM), SDPA routed "
        "to the efficient op served by cpdoctor's CPU stand-in; the trainer's own code unchanged"
    ),
}
"""What each emulation fakes, as the report says it."""


def emulation_note(modes: Iterable[object]) -> str | None:
    said = [NOTES[str(getattr(m, "value", m))] for m in modes]
    return "; ".join(said) if said else None


def apply(modes: Iterable[str]) -> None:
    """Fake each mode's environment in this process (once, at arming)."""
    for mode in modes:
        if mode == "diffusers-cpu":
            diffusers_cpu()
        if mode == "torchtitan-cpu":
            from cpdoctor.peer_impls.titan_cpu import emulate

            emulate()


def diffusers_cpu() -> None:
    """diffusers' CP on CPU ranks: the accelerator count at least 1 for the process's life, and cpdoctor's CPU backend
    registered (in the ranks only: importing diffusers costs seconds, and torchrun's agent runs no model)."""
    import os

    from cpdoctor.compat.diffusers import count_accelerators_as_at_least_one

    count_accelerators_as_at_least_one()
    if "RANK" in os.environ:
        from cpdoctor.cpu_kernels import cpu_backend

        cpu_backend.register()
