"""A watched step's CP degrees and this rank's CP group, for any model: a diffusers transformer with
`enable_parallelism`, or a model whose CP is not diffusers' (torch's context_parallel in torchtitan, a peer
library, the user's own), where nothing on the model says how the job is laid out.

Where the degrees come from, the first that says (several that say must agree):
1. the function's arguments: `cpdoctor step`'s two runs hand a function that takes its degrees the `ring`,
   `ulysses` and `dp` of the run (two_runs.StepJob); `watch_step(model, ring=..., dp=...)` likewise;
2. a CP process group the user passes (`cp_group=`): its ranks are this rank's CP group, its size the CP degree;
3. a device mesh the user passes (`mesh=`): its `cp` dimension (torchtitan's `parallel_dims.get_mesh("cp")`), or its
   `ring` / `ulysses` dimensions (diffusers' convention), or all of it when it has neither (a 1-D CP mesh);
4. the diffusers model's own parallel config (`enable_parallelism`: compat/parallel_config.py reads it);
5. torchrun's world and one declared degree: cp = world / dp, or dp = world / cp, CP groups of consecutive ranks
   (torchtitan's `(pp, batch, cp, tp)` mesh and diffusers' `(dp, ring, ulysses)` alike).

Pure: the caller hands in what the process group says (rank, world, a group's ranks); nothing here talks to
other ranks. The refusal of one run for a model cpdoctor cannot rebuild (the one-run reference is a copy of a
diffusers class built from its config) is spelled here, with the two-run command that does examine it."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cpdoctor.errors import BadInput

CP_DIMS = ("cp", "ring", "ulysses")
"""Mesh dimension names that are context parallelism: torchtitan's `cp`; diffusers' `ring` and `ulysses`."""


class DegreeSource(str, enum.Enum):
    """What told cpdoctor the job's CP layout."""

    ARGUMENTS = "arguments"
    GROUP = "group"
    MESH = "mesh"
    DIFFUSERS = "diffusers"
    WORLD = "world"


@dataclass(frozen=True)
class JobDegrees:
    """The job's layout as this rank sees it."""

    ring: int
    ulysses: int
    dp: int
    source: DegreeSource
    cp_ranks: tuple[int, ...]
    """This rank's CP group: global ranks in group order (the first is its leader)."""

    @property
    def cp(self) -> int:
        return self.ring * self.ulysses


@dataclass(frozen=True)
class Declared:
    """Degrees stated outright: the function's arguments or watch_step's keywords (None: not said)."""

    ring: int | None = None
    ulysses: int | None = None
    dp: int | None = None

    @property
    def says_cp(self) -> bool:
        return self.ring is not None or self.ulysses is not None

    @property
    def cp(self) -> int:
        return (self.ring or 1) * (self.ulysses or 1)


@dataclass(frozen=True)
class Given:
    """What the caller says about the job's layout besides the model: the degrees (`cpdoctor step`'s function
    arguments, watch_step's `ring=` / `ulysses=` / `dp=`), a CP process group or a device mesh it passes, and the
    `cpdoctor step` target a refusal names in its two-run command."""

    declared: Declared = Declared()
    cp_group: Any = None
    mesh: Any = None
    target: str | None = None


def consecutive_group(rank: int, cp: int) -> tuple[int, ...]:
    """The CP group of `rank` when CP groups are blocks of `cp` consecutive ranks."""
    first = rank // cp * cp
    return tuple(range(first, first + cp))


def mesh_layout(mesh: Any, rank: int) -> tuple[int, int, tuple[int, ...]]:
    """(ring, ulysses, this rank's CP group) read from a device mesh (`mesh_dim_names`, and `mesh`, the tensor of
    global ranks): its `cp` dimension, else its `ring` and `ulysses` dimensions, else all of it."""
    names = tuple(mesh.mesh_dim_names or ())
    grid = mesh.mesh
    if names and "cp" in names:
        cp_dims = [names.index("cp")]
        ring, ulysses = int(grid.shape[cp_dims[0]]), 1
    elif any(n in names for n in ("ring", "ulysses")):
        cp_dims = [names.index(n) for n in ("ring", "ulysses") if n in names]
        ring = int(grid.shape[names.index("ring")]) if "ring" in names else 1
        ulysses = int(grid.shape[names.index("ulysses")]) if "ulysses" in names else 1
    else:
        cp_dims = list(range(grid.ndim))
        ring, ulysses = int(grid.numel()), 1
    where = (grid == rank).nonzero()
    if where.numel() == 0:
        raise BadInput(f"rank {rank} is not in the mesh you passed ({tuple(grid.shape)}, dims {names or 'unnamed'})")
    index = [slice(None) if d in cp_dims else int(where[0, d]) for d in range(grid.ndim)]
    return ring, ulysses, tuple(int(r) for r in grid[tuple(index)].reshape(-1).tolist())


def job_degrees(
    *,
    rank: int,
    world: int,
    declared: Declared = Declared(),
    group_ranks: Sequence[int] | None = None,
    mesh: Any = None,
    diffusers: tuple[int, int] | None = None,
    diffusers_ranks: Sequence[int] | None = None,
) -> JobDegrees:
    """The job's degrees from the first source that says (module docstring); BadInput when sources disagree or
    none says anything about CP."""
    said: list[JobDegrees] = []
    if declared.says_cp:
        said.append(_with_dp(declared.ring or 1, declared.ulysses or 1, declared.dp, world, DegreeSource.ARGUMENTS, rank, None))
    if group_ranks is not None:
        ranks = tuple(int(r) for r in group_ranks)
        said.append(_with_dp(len(ranks), 1, declared.dp, world, DegreeSource.GROUP, rank, ranks))
    if mesh is not None:
        ring, ulysses, ranks = mesh_layout(mesh, rank)
        said.append(_with_dp(ring, ulysses, declared.dp, world, DegreeSource.MESH, rank, ranks))
    if diffusers is not None:
        ranks = tuple(diffusers_ranks) if diffusers_ranks is not None else None
        said.append(_with_dp(diffusers[0], diffusers[1], declared.dp, world, DegreeSource.DIFFUSERS, rank, ranks))
    if not said and declared.dp is not None:
        if world % declared.dp:
            raise BadInput(f"dp {declared.dp} does not divide the world of {world} ranks")
        said.append(_with_dp(world // declared.dp, 1, declared.dp, world, DegreeSource.WORLD, rank, None))
    if not said:
        raise BadInput(no_degrees_text(world))
    first = said[0]
    for other in said[1:]:
        if other.cp != first.cp or (other.cp_ranks != first.cp_ranks):
            raise BadInput(f"the job's CP layout is said two ways: {_says(first)} but {_says(other)}; pass one, or make them agree")
    return first


def _with_dp(
    ring: int, ulysses: int, dp: int | None, world: int, source: DegreeSource, rank: int, ranks: tuple[int, ...] | None
) -> JobDegrees:
    for name, value in (("ring", ring), ("ulysses", ulysses)):
        if value < 1:
            raise BadInput(f"{name} must be a positive integer, not {value}")
    cp = ring * ulysses
    if dp is None:
        if world % cp:
            raise BadInput(f"CP degree {cp} ({source.value}) does not divide the world of {world} ranks")
        dp = world // cp
    if dp * cp != world:
        raise BadInput(f"dp {dp} × CP {cp} ({source.value}) is {dp * cp} ranks, but the job has {world}")
    group = ranks if ranks is not None else consecutive_group(rank, cp)
    if len(group) != cp or rank not in group:
        raise BadInput(f"rank {rank}'s CP group {list(group)} ({source.value}) does not hold it with {cp} ranks")
    return JobDegrees(ring, ulysses, dp, source, group)


def _says(d: JobDegrees) -> str:
    return f"{d.source.value}: CP {d.cp} (ring {d.ring} × Ulysses {d.ulysses}) over ranks {list(d.cp_ranks)}"


def no_degrees_text(world: int) -> str:
    return (
        f"nothing says how this job of {world} ranks is laid out for CP: the model has no diffusers parallel config, and "
        "no degrees, CP group or mesh were given. Pass them: watch_step(model, cp_group=...) or mesh=... (the CP "
        "dimension named cp, or ring and ulysses), or ring=/dp=; with `cpdoctor step`, a function that takes its "
        "degrees (cp, ring, ulysses, dp or job) gets them"
    )


def rebuildable(module: Any) -> bool:
    """Whether the one-run reference can rebuild `module` in one process: a diffusers model class (its
    `from_config`, under FSDP2's subclass) with its `config`."""
    from cpdoctor.examinations.step.judgment.reference import model_class

    return hasattr(model_class(module), "from_config") and getattr(module, "config", None) is not None


def two_run_command(target: str | None, degrees: JobDegrees | Declared | None) -> str:
    """`cpdoctor step PATH:FUNCTION --ring R [--ulysses U] [--dp D]` for the degrees known (placeholders else)."""
    where = target or "path/to/train.py:step"
    ring = getattr(degrees, "ring", None) or 2
    parts = [f"cpdoctor step {where} --ring {ring}"]
    ulysses = getattr(degrees, "ulysses", None)
    if ulysses and ulysses > 1:
        parts.append(f"--ulysses {ulysses}")
    dp = getattr(degrees, "dp", None)
    if dp and dp > 1:
        parts.append(f"--dp {dp}")
    return " ".join(parts)


def one_run_refusal(module: Any, target: str | None = None, degrees: JobDegrees | Declared | None = None) -> str:
    """Why `module` cannot be examined in one run, and the two-run command that examines it."""
    name = type(module).__name__
    return (
        f"{name} cannot be examined in one run: the one-run reference rebuilds the model in one process from its "
        f"diffusers class and config, and {name} is not a diffusers model. Examine it in two runs, which need no copy: "
        "give the step function its degrees (e.g. `def step(job, cp, dp)`: build the model and mesh from them, seed "
        "weights and data by the data-parallel rank, run the step inside `with job(model):`) and run "
        f"`{two_run_command(target, degrees)}`: cpdoctor runs it without CP first and compares the final gradients"
    )
