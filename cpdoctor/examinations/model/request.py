"""The request of a model-level CP examination (`cpdoctor model`), as plain data.

Like `AttentionRequest` it validates itself (BadInput, one line) before any process starts. What depends on
the model (a tiny config to build, safetensors to load, a text mask to pad, default shapes, divisibility) is
checked by `cpdoctor.examinations.model.probe.prepare`, which needs diffusers; `validate()` here needs nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from cpdoctor.errors import BadInput
from cpdoctor.examinations.request import LayoutRequest, require_ints
from cpdoctor.vocabulary import DType, Kind


@dataclass(frozen=True)
class ModelRequest(LayoutRequest):
    """One model-level CP parity examination: a real diffusers model class through `enable_parallelism`.

    `model` is a short name (flux, ltx, helios: a tiny config derived from the class), a class name or a local
    checkpoint directory; with `config` (a config.json path) the class's model at that config with random weights.
    Shapes left None are filled by `prepare` from the model family (small, and divisible by ring x ulysses up to 8)."""

    kind = Kind.MODEL  # the examination this request is for (registry.of)

    label = "model-request"

    model: str = "flux"
    height: int | None = None
    width: int | None = None
    text_len: int | None = None
    frames: int | None = None
    batch: int = 1
    emulate: bool = False  # the CUDA backends' CP code on CPU through cpdoctor's kernel stand-ins
    checkpointing: bool = False
    """The CP run through the model's own `enable_gradient_checkpointing()` (diffusers' default: torch's
    non-reentrant checkpoint around every block), as trainers run it; the one-process reference without."""
    # where a checkpoint's weights come from (cpdoctor.model_zoo.checkpoints): the hub revision (branch, tag or
    # commit; `prepare` pins it to the commit found), the file variant (fp16, bf16), whether to fetch a hub
    # checkpoint missing from the local cache, whether pickle weights (.bin) may be loaded
    revision: str | None = None
    variant: str | None = None
    download: bool = False
    allow_pickle: bool = False
    config: str | None = None
    """A config.json (`--config`): the class's model at that config (full width, say) with seeded random weights."""
    # examine the input embedders, the first `blocks` blocks of each block stack and the output layers (None:
    # `prepare` picks the most that fit in memory and records the number here)
    blocks: int | None = None
    # the reference's dtype, fp64 or fp32 where fp64 does not fit (set by `prepare` from the memory plan)
    reference: DType | None = None
    memory: Any = field(default=None, compare=False, repr=False)
    """The memory plan `prepare` made (cpdoctor.model_zoo.memory.MemoryPlan): printed before launch, kept in the
    finding; not part of what the user asked for (`to_dict` leaves it out)."""
    timing: Any = field(default=None, compare=False, repr=False)
    """The time plan `prepare` made (cpdoctor.model_zoo.throughput.TimePlan) for a half dtype on the CPU, None
    otherwise: printed before launch with its slow-dtype warning; `to_dict` leaves it out too."""
    tiny: Any = field(default=None, compare=False, repr=False)
    """The tiny config `prepare` derived for a name (cpdoctor.model_zoo.tiny.TinyConfig), carried to the ranks so
    that none derives it again; the finding shows it (`to_dict` leaves it out)."""
    misfit: Any = field(default=None, compare=False, repr=False)
    """What `prepare` found of the class's `_cp_plan` that the model at these blocks does not have
    (cpdoctor.model_zoo.plan_fit.PlanMisfit): the examination refuses it before any launch; `to_dict` leaves it out."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.reference, str) and self.reference in DType.names():  # any other word: `validate` refuses it
            object.__setattr__(self, "reference", DType(self.reference))

    def validate(self) -> ModelRequest:
        if not isinstance(self.model, str) or not self.model.strip():
            raise BadInput("give a MODEL: a short name (see `cpdoctor plan --list`), a class name or a checkpoint directory")
        self.validate_common()
        require_ints(self, ("batch", "height", "width", "text_len", "frames", "blocks"))
        if self.reference is not None and self.reference not in DType.references():
            raise BadInput(f"reference must be fp64 or fp32, got {str(self.reference)!r}")
        if self.blocks is not None and self.blocks < 1:
            raise BadInput(f"--blocks must be at least 1, got {self.blocks}")
        if self.config is not None and (not isinstance(self.config, str) or not self.config.strip()):
            raise BadInput(f"--config must be the path of a config.json, got {self.config!r}")
        if not isinstance(self.checkpointing, bool):
            raise BadInput(f"checkpointing must be true or false, got {self.checkpointing!r}")
        if self.batch < 1:
            raise BadInput(f"--batch must be at least 1, got {self.batch}")
        for name in ("height", "width", "text_len", "frames"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise BadInput(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.text_len is not None and self.mask_pad >= self.text_len:
            raise BadInput(f"--mask-pad must be between 0 and text-len - 1 = {self.text_len - 1}, got {self.mask_pad}")
        return self

    def with_fields(self, **changes: object) -> ModelRequest:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        data = asdict(self)
        for derived in ("memory", "timing", "tiny", "misfit"):
            data.pop(derived)
        return data
