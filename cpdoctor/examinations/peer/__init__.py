"""The peer examination (kind "peer"): someone else's CP attention — ring-flash-attn, yunchang, PyTorch's
context_parallel — on sequence shards, forward and backward, every rank against the full-sequence fp64
reference, judged like diffusers' (the shared tolerance and row judging, a rules table of its own).

Each implementation is an adapter in cpdoctor/peer_impls/; this package is the Examination entry: the request
validated with the implementation's own reasons, UNSUPPORTED from the parent when its package is missing,
the probe (run_rank / evaluate) and the judge."""

from __future__ import annotations

from dataclasses import replace

from cpdoctor.errors import Unsupported, UnsupportedKind
from cpdoctor.examinations.base import Examination
from cpdoctor.examinations.measurement import Measurement
from cpdoctor.examinations.peer import judge
from cpdoctor.examinations.peer.request import PeerRequest
from cpdoctor.launch.jobs import Case, RankFailure
from cpdoctor.peer_impls.source import peer_frame
from cpdoctor.report import Finding
from cpdoctor.vocabulary import Device, Kind


class PeerExamination(Examination[PeerRequest]):
    kind = Kind.PEER
    probe = "cpdoctor.examinations.peer.probe"
    request_type = PeerRequest

    def prepare(self, request: PeerRequest) -> PeerRequest:
        return request  # validated where it was built (PeerRequest.of): nothing depends on the installed software

    def unsupported_here(self, request: PeerRequest) -> Unsupported | None:
        """A peer that is not installed, or a kernel the peer has no backward for: known from the parent in well
        under a second (importlib's finder and the installed source, no import)."""
        peer = request.adapter
        spec = peer.spec
        if not peer.installed():
            return Unsupported(UnsupportedKind.MISSING_PACKAGE, f"{spec.distribution} is not installed here; install it: {spec.install}")
        for what, name, line in (
            ("variant", request.variant, request.the_variant.no_backward),
            ("kernel", request.kernel, request.the_kernel.no_backward),
        ):
            if line is not None:
                found = line.read()
                said = f"{found.text!r} at {found.location}" if found is not None else "its backward raises"
                return Unsupported(
                    UnsupportedKind.NO_BACKWARD,
                    f"{spec.impl.value}'s {name} {what} runs forward only ({said}); every peer check back-propagates",
                )
        return None

    def unsupported_finding(self, request: PeerRequest, why: Unsupported) -> Finding:
        """The UNSUPPORTED finding for what `unsupported_here` returned, with the peer's remedy (the install
        command, or the kernels and variants that have a backward)."""
        return judge.unsupported(request, why)

    def cases(self, request: PeerRequest) -> list[Case]:
        return [Case(request)]

    def world_size(self, request: PeerRequest) -> int:
        return request.world_size

    def device(self, request: PeerRequest) -> str:
        return "cpu" if request.emulate else request.device

    def finding(self, case: Case, evaluated: Measurement) -> Finding:
        return judge.peer_finding(case.request, evaluated)

    def describe(self, request: PeerRequest) -> str:
        return judge.describe(request)

    def failure_findings(self, case: Case, failures: list[RankFailure], timeout_s: float) -> list[Finding]:
        """CRASH / HANG as for every examination, with the peer's own line that raised (from the traceback)."""
        req: PeerRequest = case.request
        module = req.adapter.spec.module
        frames = [peer_frame(f.traceback, module) for f in failures if not f.waiting]
        frame = next((f for f in frames if f is not None), None)
        raised_in = f" — raised in {req.impl}'s code at {frame.location}: {frame.text}" if frame is not None else ""
        found = judge.JUDGE.failure_findings(self.describe(req), failures, timeout_s, raised_in=raised_in)
        found = [replace(f, command=judge.check_command(req)) for f in found]
        if req.device is not Device.CUDA:
            emulated = f"ran on CPU ranks through cpdoctor's stand-ins ({req.the_kernel.standin}) where no GPU was used"
            found = [replace(f, emulated=emulated) for f in found]
        return found


EXAMINATION = PeerExamination()
