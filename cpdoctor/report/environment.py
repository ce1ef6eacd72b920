"""Where something ran, typed: the `Environment` of a report (the machine, and the launch when there is one) and
of each finding (the launch its ranks ran in).

Every producer fills the fields it knows and leaves the rest None: rank 0 of an attention or model check
(versions, device, process group, layout, the backend it chose), a peer's rank 0 (its impl/variant/kernel/
layout instead of a backend), the parent when no rank reported (the layout as asked), `cpdoctor env` (its list
of facts), `cpdoctor plan` (the meta device), a watched training step, a suite (the machine only) and the
doctor (plus the accelerators and the backends seen). JSON (`to_jsonable`, through report/serialize.py) holds
exactly the fields that are set, so a key a producer never wrote stays absent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

PER_CHECK = ("world_size", "ring", "ulysses", "backend", "dtype", "model", "impl", "variant", "kernel", "layout", "emulated")
"""The fields that belong to one check of a suite, not to the machine it ran on."""


@dataclass(frozen=True)
class Environment:
    """One environment; None = not known to (or not written by) whoever built it. Field order is the order of
    `cpdoctor env`'s list, which renders `items()` as it comes."""

    python: str | None = None
    os: str | None = None
    """`cpdoctor env` only, as are the fields down to `settings` (a fact that could not be gathered reads
    "could not collect" instead of its type)."""
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
    device: str | None = None
    """Where the ranks ran ("cpu", "cuda:0 (NVIDIA H200)"; "meta" for a plan, the user's device for a step)."""
    process_group: str | None = None
    world_size: int | None = None
    accelerators: int | None = None
    """The doctor's count of visible accelerators."""
    ring: int | None = None
    ulysses: int | None = None
    backend: str | None = None
    """The attention backend the ranks chose ("auto" when asked for and nobody reported; the doctor's: every
    backend its checks chose, joined)."""
    model: str | None = None
    impl: str | None = None
    """A peer's implementation and its installed version ("ring-flash-attn 2.8.3")."""
    variant: str | None = None
    kernel: str | None = None
    layout: str | None = None
    """A peer's token layout (variant and kernel: the vocabulary's `str` enums, as the request held them)."""
    dtype: str | None = None
    """The vocabulary's `DType` where a request gave it (a `str` enum; JSON holds its value)."""
    emulated: str | None = None
    """What an emulated run examined and what it did not."""
    probe_device: str | None = None
    probe_dtype: str | None = None
    ring_class: str | None = None
    """`cpdoctor env`: the device and dtype its backend rows ran on, and which ring class this process runs."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Environment:
        """The environment of plain data (a payload, a test's fixture); TypeError names an unknown key."""
        return cls(**data)

    def items(self) -> Iterator[tuple[str, Any]]:
        """(name, value) of every field that is set, in field order (what JSON, JUnit and `cpdoctor env` list)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                yield f.name, value

    def replace(self, **changes: Any) -> Environment:
        """A copy with `changes` (None unsets a field)."""
        return dataclasses.replace(self, **changes)

    def machine_only(self) -> Environment:
        """Without the fields of one check (`PER_CHECK`): a suite's own environment, its findings keep theirs."""
        return self.replace(**dict.fromkeys(PER_CHECK))

    def to_jsonable(self) -> dict[str, Any]:
        """The JSON object: the fields that are set (report/serialize.py turns enums and nested values plain)."""
        from cpdoctor.report.serialize import to_jsonable

        return {name: to_jsonable(value) for name, value in self.items()}
