"""Where something ran, typed: the `Environment` of a report (the machine, and the launch when there is one) and
of each finding (the launch its ranks ran in), in four parts by what each describes:

- `Software`: the machine and what is installed on it (versions, CUDA, devices, the torchrun world, settings,
  the doctor's count of accelerators): `cpdoctor env` gathers all of it, a rank the versions it runs;
- `Launch`: where the ranks ran and their layout (device, process group, world size, degrees, dtype, model,
  what was emulated);
- `AttentionBackend`: the attention backend the ranks chose (the doctor's: every one its checks chose), and
  where `cpdoctor env` probed the backends;
- `PeerLayout`: a peer's implementation, variant, kernel and token layout, instead of a backend.

Every producer fills the fields it knows and leaves the rest None: rank 0 of an attention or model check
(versions, launch, the backend it chose), a peer's rank 0 (its peer layout instead of a backend), the parent when
no rank reported (the layout as asked), `cpdoctor env` (its list of facts), `cpdoctor plan` (the meta device), a
watched training step, a suite (the machine and where its ranks ran) and the doctor (plus the accelerators and the
backends seen). The JSON is one flat object (a contract, README), in `KEYS`' order, holding exactly the fields
that are set, so a key a producer never wrote stays absent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

P = TypeVar("P", bound="EnvironmentPart")


@dataclass(frozen=True)
class EnvironmentPart:
    """Base of an environment's parts: frozen, every field None when not known."""

    def set_fields(self) -> Iterator[tuple[str, Any]]:
        """(name, value) of every field that is set."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                yield f.name, value

    def replace(self: P, **changes: Any) -> P:
        """A copy with `changes` (None unsets a field)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Software(EnvironmentPart):
    """The machine and what is installed on it. `cpdoctor env` fills every field (a fact that could not be gathered
    reads "could not collect" instead of its type); a rank, the versions it runs; the doctor, `accelerators`."""

    python: str | None = None
    os: str | None = None
    cpdoctor: str | None = None
    torch: str | None = None
    torch_cuda_build: str | None = None
    cuda_available: bool | str | None = None
    cudnn: str | None = None
    nccl: str | None = None
    gloo: bool | str | None = None
    devices: list[str] | str | None = None
    diffusers: str | None = None
    attention_packages: dict[str, str] | str | None = None
    world: dict[str, object] | str | None = None
    settings: dict[str, str] | str | None = None
    accelerators: int | None = None
    """The doctor's count of visible accelerators."""


@dataclass(frozen=True)
class Launch(EnvironmentPart):
    """Where the ranks ran and what layout they ran: the fields of one check, but `device` and `process_group`,
    which a suite's ranks share (`where`)."""

    device: str | None = None
    """Where the ranks ran ("cpu", "cuda:0 (NVIDIA H200)"; "meta" for a plan, the user's device for a step)."""
    process_group: str | None = None
    world_size: int | None = None
    ring: int | None = None
    ulysses: int | None = None
    model: str | None = None
    dtype: str | None = None
    """The vocabulary's `DType` where a request gave it (a `str` enum; JSON holds its value)."""
    emulated: str | None = None
    """What an emulated run examined and what it did not."""

    def where(self) -> Launch:
        """Only where the ranks ran (device, process group): what a suite's launches share."""
        return Launch(device=self.device, process_group=self.process_group)


@dataclass(frozen=True)
class AttentionBackend(EnvironmentPart):
    """The attention backend: the one the ranks chose ("auto" when asked for and nobody reported; the doctor's:
    every backend its checks chose, joined), and `cpdoctor env`'s: the device and dtype its backend rows ran on and
    which ring class this process runs."""

    backend: str | None = None
    probe_device: str | None = None
    probe_dtype: str | None = None
    ring_class: str | None = None


@dataclass(frozen=True)
class PeerLayout(EnvironmentPart):
    """A peer's implementation and its installed version ("ring-flash-attn 2.8.3"), its variant and kernel (the
    vocabulary's `str` enums, as the request held them) and its token layout."""

    impl: str | None = None
    variant: str | None = None
    kernel: str | None = None
    layout: str | None = None


KEYS = (
    "python", "os", "cpdoctor", "torch", "torch_cuda_build", "cuda_available", "cudnn", "nccl", "gloo", "devices",
    "diffusers", "attention_packages", "world", "settings", "device", "process_group", "world_size", "accelerators",
    "ring", "ulysses", "backend", "model", "impl", "variant", "kernel", "layout", "dtype", "emulated", "probe_device",
    "probe_dtype", "ring_class",
)  # fmt: skip
"""The JSON's keys in their order (`cpdoctor env`'s list renders them as they come): every field of the four
parts, once."""


PARTS: tuple[type[EnvironmentPart], ...] = (Software, Launch, AttentionBackend, PeerLayout)
"""The parts, in `Environment`'s field order."""


@dataclass(frozen=True)
class Environment:
    """One environment, in its four parts (each empty when nobody wrote it)."""

    software: Software = field(default_factory=Software)
    launch: Launch = field(default_factory=Launch)
    attention: AttentionBackend = field(default_factory=AttentionBackend)
    peer: PeerLayout = field(default_factory=PeerLayout)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Environment:
        """The environment of a flat JSON-shaped mapping (a test's fixture); TypeError names an unknown key."""
        unknown = set(data) - set(KEYS)
        if unknown:
            raise TypeError(f"unknown environment keys: {', '.join(sorted(unknown))}")
        return cls(*(part(**{f.name: data[f.name] for f in dataclasses.fields(part) if f.name in data}) for part in PARTS))

    def items(self) -> Iterator[tuple[str, Any]]:
        """(name, value) of every field that is set, in `KEYS`' order (what JSON, JUnit and `cpdoctor env` list)."""
        values = dict(kv for part in (self.software, self.launch, self.attention, self.peer) for kv in part.set_fields())
        for name in KEYS:
            if name in values:
                yield name, values[name]

    def get(self, key: str) -> Any:
        """The value under a JSON key (None when not set): for a line that lists a few keys as JSON names them."""
        return dict(self.items()).get(key)

    def replace(self, **parts: Any) -> Environment:
        """A copy with the given parts replaced (`software=`, `launch=`, `attention=`, `peer=`)."""
        return dataclasses.replace(self, **parts)

    def machine_only(self) -> Environment:
        """Without the fields of one check (its layout, backend and peer): a suite's own environment, whose findings
        keep theirs; the machine, where the ranks ran, and where `cpdoctor env` probed stay."""
        return Environment(self.software, self.launch.where(), self.attention.replace(backend=None))

    def to_jsonable(self) -> dict[str, Any]:
        """The JSON object: the fields that are set (report/serialize.py turns enums and nested values plain)."""
        from cpdoctor.report.serialize import to_jsonable

        return {name: to_jsonable(value) for name, value in self.items()}
