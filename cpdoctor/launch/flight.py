"""Which collective each rank is in, as NCCL's flight recorder keeps it: while a spawned rank examines, every
collective it enters is counted and the one it is blocked in (entered, not left) is written to its flight file
beside its step file (progress.StepLog.collectives), so the supervising parent can tell a rank that stopped
outside any collective from the peers that wait for it inside one (progress.blame).

What is wrapped, while armed, is the narrowest public layer the CP attentions call at run time:
- torch's functional collectives (`torch.distributed._functional_collectives`: all_gather_single/_tensor,
  all_to_all_single, permute_tensor, all_reduce, broadcast, reduce_scatter and their coalesced and autograd
  forms), which diffusers' templates and torch's `context_parallel` use. They return at once (the transfer runs
  behind an `AsyncCollectiveTensor`): entering counts the collective, and the rank is *in* it while it waits
  for the result (`funcol.wait_tensor`, which every wait of such a tensor goes through);
- `torch.distributed`'s collectives and point-to-point calls (`dist.all_gather`, `all_to_all_single`,
  `batch_isend_irecv`, `barrier`, `send`, `recv`, ...), which the peers (ring-flash-attn, yunchang) and
  cpdoctor's fixed ring use: a blocking call is the rank being in it; with `async_op=True` (and
  `batch_isend_irecv`) the rank is in it while it waits on the returned `Work` (`Work.wait`).
Not seen: `dist.isend`/`dist.irecv` called alone (torch checks a `P2POp`'s function by identity, so they are not
replaced; `batch_isend_irecv` is), and a function bound by name before the recorder was armed.

One small write per enter, wait and leave (one `pwrite` in place, about 1 µs; nothing per element): about 50 µs
of Python per functional collective issued and waited for, measured at load 13 on 2 cores; a ring-2 rank's
`check` makes 4 collectives, and its 55-300 ms (15 runs armed and 15 not, interleaved) did not measurably change. Counts start at zero for every case: every rank of a CP attention
makes the same collectives in the same order, so the counts of ranks in one case compare (where they do not, the
blame names every rank rather than guess).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from cpdoctor.launch.progress import ACTIVE, Collectives
from cpdoctor.patching import Patches

FUNCTIONAL = {
    "all_gather_single": "all_gather",
    "all_gather_tensor": "all_gather",
    "all_gather_tensor_autograd": "all_gather",
    "all_gather_single_autograd": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "all_to_all_single": "all_to_all",
    "all_to_all_single_autograd": "all_to_all",
    "permute_tensor": "permute",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "broadcast": "broadcast",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor_autograd": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
}
"""torch.distributed._functional_collectives' functions → the collective's name in a report. Those that call
another of them (all_gather_tensor → all_gather_single) count once, under the outer name."""

DISTRIBUTED = {
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_object": "all_gather",
    "all_reduce": "all_reduce",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_object_list": "broadcast",
    "barrier": "barrier",
    "gather": "gather",
    "gather_object": "gather",
    "scatter": "scatter",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "send": "send",
    "recv": "recv",
    "batch_isend_irecv": "send/recv",
}
"""torch.distributed's functions → the collective's name in a report."""


@dataclass
class _Pending:
    """A collective entered whose result is still to be waited for: what its wait receives (a functional
    collective's result tensor, or a view of it; a Work), held until then, and the collective's name and number."""

    held: Any
    op: str
    seq: int


def _key(target: Any) -> tuple[str, int]:
    """What a wait is matched by: a Work itself; a tensor by its storage (a functional collective's result is
    often waited through a view of it, `chunk` or `view`, which is another tensor on the same storage). funcol's
    `AsyncCollectiveTensor` (torchtitan's `dist_sum_tensor` waits on one) holds no storage of its own: its `elem`
    does; any other wrapper subclass without storage is matched by identity (an unmatched wait just runs)."""
    import torch

    if isinstance(target, torch.Tensor):
        inner = getattr(target, "elem", None)
        target = inner if isinstance(inner, torch.Tensor) else target
        try:
            return "storage", target.untyped_storage().data_ptr()
        except RuntimeError:  # "invalid python storage": a wrapper subclass; never raise into the step
            return "tensor", id(target)
    return "work", id(target)


class FlightRecorder:
    """The collectives this rank entered in the current case and the one it is blocked in.

    Lifetime: armed by the worker around each case's `run_rank` (`recording`) in a spawned rank, which wraps the
    functions listed above; disarmed in a `finally`, which restores every original and empties the record.
    Never armed in any other process (the parent, a training script under torchrun, where nobody supervises).
    `stall_first` (a test's injected fault, faults.py) makes the first collective entered sleep for ever instead,
    once, and is cleared when disarmed. Collectives are issued one at a time (the rank's thread, or autograd's
    on its behalf), so `depth` need not be per thread."""

    def __init__(self) -> None:
        self.patches = Patches()  # the collectives wrapped (patching.py, the mechanism the step watcher shares)
        self.entered = 0
        self.depth = 0
        self.pending: dict[tuple[str, int], _Pending] = {}
        self.stall_first = False

    @property
    def armed(self) -> bool:
        return bool(self.patches)

    def arm(self) -> None:
        """Wrap the collectives and their waits (armed twice is a no-op) and start the count at zero."""
        if self.armed:
            return
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        for module, names, wrap in ((funcol, FUNCTIONAL, self._functional), (dist, DISTRIBUTED, self._distributed)):
            for name, op in names.items():
                original = getattr(module, name, None)
                if callable(original):
                    self._install(module, name, original, wrap(original, op))
        self._install(funcol, "wait_tensor", funcol.wait_tensor, self._waiting(funcol.wait_tensor))
        self._install(dist.Work, "wait", dist.Work.wait, self._waiting(dist.Work.wait))
        self._reset()

    def _install(self, owner: Any, name: str, original: Any, wrapper: Any) -> None:
        self.patches.install(owner, name, original, wrapper)

    def disarm(self) -> None:
        """Restore every original and empty the record (the flight file says no collective again). A function
        wrapped again over ours meanwhile (the step watcher's reductions, left open) keeps that wrapper, whose
        inner call of ours now passes straight through."""
        self.patches.restore()
        self.stall_first = False
        self._reset()

    def _reset(self) -> None:
        self.entered, self.depth = 0, 0
        self.pending.clear()
        _write(Collectives())

    # ---------------------------------------------------------------------------------------- the record

    def _enter(self) -> int:
        """Count one collective entered (after the injected stall, if any) and write it; its number."""
        if self.stall_first:
            while True:  # a rank asleep inside the attention, outside any collective: never ticks
                time.sleep(3600)
        self.entered += 1
        _write(Collectives(self.entered))
        return self.entered

    def _block(self, op: str, seq: int) -> None:
        _write(Collectives(self.entered, op, seq))

    def _leave(self) -> None:
        _write(Collectives(self.entered))

    def _remember(self, result: Any, op: str, seq: int) -> None:
        """Note what the wait of an issued collective will receive: a functional collective's tensor(s), a Work or
        a list of Works."""
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        for item in result if isinstance(result, (list, tuple)) else [result]:
            if isinstance(item, funcol.AsyncCollectiveTensor):
                item = item.elem
            elif not isinstance(item, dist.Work):
                continue  # already waited (traced), or not a member of the group (None)
            self.pending[_key(item)] = _Pending(item, op, seq)

    # ---------------------------------------------------------------------------------------- the wrappers

    def _functional(self, original: Callable[..., Any], op: str) -> Callable[..., Any]:
        @functools.wraps(original)
        def entered(*args: Any, **kwargs: Any) -> Any:
            if self.depth or not self.armed:
                return original(*args, **kwargs)
            seq = self._enter()
            self.depth += 1
            try:
                result = original(*args, **kwargs)
            finally:
                self.depth -= 1
            self._remember(result, op, seq)
            return result

        return entered

    def _distributed(self, original: Callable[..., Any], op: str) -> Callable[..., Any]:
        """A torch.distributed call: the rank is in the collective during the call (all of it, for a blocking
        one) and, for each `Work` it returns (`async_op=True`, `batch_isend_irecv`), while it waits on it."""

        @functools.wraps(original)
        def entered(*args: Any, **kwargs: Any) -> Any:
            if self.depth or not self.armed:
                return original(*args, **kwargs)
            seq = self._enter()
            self._block(op, seq)
            self.depth += 1
            try:
                result = original(*args, **kwargs)
            finally:
                self.depth -= 1
                self._leave()
            self._remember(result, op, seq)
            return result

        return entered

    def _waiting(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """The wait of an issued collective (`funcol.wait_tensor(tensor)`, `Work.wait(self)`): the rank is in that
        collective until it returns."""

        @functools.wraps(original)
        def wait(target: Any, *args: Any, **kwargs: Any) -> Any:
            pending = self.pending.pop(_key(target), None) if self.armed and self.pending else None
            if pending is None:  # not one we saw issued, or already waited for
                return original(target, *args, **kwargs)
            self._block(pending.op, pending.seq)
            try:
                return original(target, *args, **kwargs)
            finally:
                self._leave()

        return wait


FLIGHT = FlightRecorder()


def _write(record: Collectives) -> None:
    if ACTIVE.log is not None:
        ACTIVE.log.collectives(record)


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Record this rank's collectives for the block, where a parent supervises (a rank with a step file);
    elsewhere nothing is wrapped."""
    if ACTIVE.log is None or ACTIVE.log.path is None or FLIGHT.armed:
        yield
        return
    FLIGHT.arm()
    try:
        yield
    finally:
        FLIGHT.disarm()


def stall_at_first_collective() -> None:
    """The injected fault `stall` (faults.py): the next armed case's first collective sleeps for ever instead."""
    FLIGHT.stall_first = True
