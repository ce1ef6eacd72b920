"""What every examination's request is to the runner (`Request`, the protocol the registry, the runner and a report
read), and what the requests of diffusers' layouts share (`LayoutRequest`): the CP layout (ring × Ulysses degrees,
backend, dtype, device), the patch flag, the seed and the padding mask, validated in one place (BadInput, one line)
before any process starts, and the plain-data round trip (to_dict / from_dict) that the JSON report and suites use."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Protocol, TypeVar

from cpdoctor.errors import BadInput
from cpdoctor.report.environment import AttentionBackend, Environment, Launch
from cpdoctor.vocabulary import Device, DType, Kind, Word, parse

R = TypeVar("R", bound="LayoutRequest")


class Request(Protocol):
    """A launched examination's request, as the registry, the runner and a report read it: `AttentionRequest`,
    `ModelRequest`, `PeerRequest`, `StepRequest`, `FixTrainingRequest`, each a frozen dataclass built once where the
    input arrives and validated there (a variant of one, such as `--repro`'s cases, is `dataclasses.replace` of it).
    Nothing reads a request's field by name: what the runner needs is here, what an examination needs is its own
    request type's (`Examination[R]`)."""

    kind: ClassVar[Kind]
    """The examination it is for (`registry.of`)."""

    @property
    def world_size(self) -> int:
        """The ranks its cases run on (ring × Ulysses for a layout; the step's dp × CP)."""
        ...

    @property
    def device(self) -> Device:
        """auto (a GPU per rank when there are enough, else the CPU), cpu or cuda."""
        ...

    @property
    def patch(self) -> bool:
        """Its cases run again with cpdoctor's fix patched in (the unpatched run is the report's `before`)."""
        ...

    @property
    def emulate(self) -> bool:
        """Its ranks run the CUDA kernels' CPU stand-ins (they import diffusers after them: fresh interpreters)."""
        ...

    def asked(self) -> Environment:
        """The layout as asked (degrees, dtype, the backend as requested): what a report says of a launch that no rank
        reported on."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """JSON `request`."""
        ...


DEFAULT_SEQ = 512
"""The op-level examination's sequence length (`cpdoctor check`), before rounding to the CP world size."""


def default_seq(world_size: int) -> int:
    """512 rounded up to a multiple of the CP world size, so `--ring 3` works without choosing a length."""
    return -(-DEFAULT_SEQ // world_size) * world_size


class Unpatched:
    """Mixed into a request whose cases never run with cpdoctor's fix (it concerns diffusers' CP attention): a peer's,
    the user's step, the fix's own training step (`Request.patch` False)."""

    @property
    def patch(self) -> bool:
        return False


class NotEmulated:
    """Mixed into a request whose ranks never run the CUDA kernels' CPU stand-ins (`Request.emulate` False)."""

    @property
    def emulate(self) -> bool:
        return False


def layout_asked(ring: int | None, ulysses: int | None, dtype: str | None = None, backend: str | None = None) -> Environment:
    """`Request.asked()` of a request of these degrees, dtype and backend (None: a request without one)."""
    return Environment(launch=Launch(ring=ring, ulysses=ulysses, dtype=dtype), attention=AttentionBackend(backend))


def degrees_label(ring: int, ulysses: int) -> str:
    """A layout's degrees as its rows name it: "ring 3", "Ulysses 2", "ring 2 × Ulysses 2" (a degree of 1 unsaid)."""
    return " × ".join(p for p in (f"ring {ring}" if ring > 1 else "", f"Ulysses {ulysses}" if ulysses > 1 else "") if p)


def validate_timeout(timeout_s: float) -> None:
    """A positive, finite number of seconds (nan would never expire, inf overflows the process group)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise BadInput(f"--timeout must be a positive, finite number of seconds, got {timeout_s!r}")


def require_ints(obj: object, names: tuple[str, ...]) -> None:
    """Integer fields must be integers (a suite or an API call can pass 2.5 or "2")."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise BadInput(f"--{name.replace('_', '-')} must be an integer, got {value!r}")


def word(cls: type[Word], value: object, what: str) -> Any:
    """`value` as a member of the vocabulary enum `cls` (a member, or its string from a suite or the API);
    BadInput, one line, for any other word."""
    try:
        return parse(cls, value, what)
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def typed_words(obj: object, **enums: tuple[type[Word], str]) -> None:
    """In a frozen request's `__post_init__`: turn the named fields into their vocabulary members (the strings of
    a suite or a keyword call become enums once, here), BadInput for an unknown word."""
    for name, (cls, what) in enums.items():
        object.__setattr__(obj, name, word(cls, getattr(obj, name), what))


def validate_layout(ring: int, ulysses: int, dtype: DType, device: Device) -> None:
    """The checks every request shares: CP degrees, and a dtype an examination computes in (BadInput, one line)."""
    for name, value in (("ring", ring), ("ulysses", ulysses)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadInput(f"--{name} must be an integer, got {value!r}")
        if value < 1:
            raise BadInput(f"--{name} must be at least 1, got {value}")
    if ring * ulysses < 2:
        raise BadInput("context parallelism needs ring × ulysses ≥ 2 (got ring 1 × ulysses 1)")
    if word(DType, dtype, "dtype") not in DType.examined():
        raise BadInput(f"unknown dtype {dtype!r}; choose one of {', '.join(DType.examined())}")
    word(Device, device, "device")


def default_degrees(obj: object) -> None:
    """In a frozen request's `__post_init__`, the one place the degrees' defaults live: ring 2, or ring 1 when
    only a Ulysses degree is given; Ulysses 1."""
    ring, ulysses = obj.ring, obj.ulysses
    if ring is None:
        object.__setattr__(obj, "ring", 1 if ulysses not in (None, 1) else 2)
    if ulysses is None:
        object.__setattr__(obj, "ulysses", 1)


@dataclass(frozen=True)
class LayoutRequest:
    """Base of the requests of launched examinations (subclasses add their own fields, all with defaults)."""

    label = "request"  # "attention-request", "model-request": named in the unknown-keys error

    ring: int = None  # type: ignore[assignment]  # None: 2, or 1 when only ulysses is given (default_degrees)
    ulysses: int = None  # type: ignore[assignment]  # None: 1
    backend: str = "auto"
    dtype: DType = DType.FP32
    seed: int = 0
    mask_pad: int = 0
    device: Device = Device.AUTO
    patch: bool = False

    def __post_init__(self) -> None:
        typed_words(self, dtype=(DType, "dtype"), device=(Device, "device"))
        default_degrees(self)

    @classmethod
    def of(cls: type[R], **given: Any) -> R:
        """The validated request from keyword fields, None meaning the default: how the CLI, the API and suites
        build one (validated here, once; the ranks and the registry take it as it is)."""
        return cls.from_dict({k: v for k, v in given.items() if v is not None}).validate()

    def validate(self: R) -> R:
        """BadInput (one line, exit 2) for anything wrong with the fields; returns the request."""
        self.validate_common()
        return self

    @property
    def world_size(self) -> int:
        return self.ring * self.ulysses

    def asked(self) -> Environment:
        return layout_asked(self.ring, self.ulysses, self.dtype, self.backend)

    def validate_common(self) -> None:
        validate_layout(self.ring, self.ulysses, self.dtype, self.device)
        require_ints(self, ("seed", "mask_pad"))
        if self.mask_pad < 0:
            raise BadInput(f"--mask-pad must be at least 0, got {self.mask_pad}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls: type[R], data: dict) -> R:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise BadInput(f"unknown {cls.label} keys: {', '.join(sorted(unknown))}")
        return cls(**data)
