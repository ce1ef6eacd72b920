"""What the patch put aside: the one owner (`STATE`) of the originals `fix/patch.py` replaced and of its report.

Its own module so that both sides read it without importing each other: `patch.py` fills and empties it, and the
fixed Ulysses (`ulysses.py`) reads the original class it hands calls back to (`UlyssesAttention.original`), while
`patch.py` imports `ulysses.py` to install it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cpdoctor.fix.patch import PatchReport


class PatchState:
    """What the patch put aside in this process. Lifetime: one instance, `STATE`, created at this module's import;
    entered by the `apply` that replaces diffusers' globals (it records the originals and that apply's report); an
    `apply` while patched keeps it as it is; `revert` puts the originals back and empties it, so nothing survives a
    revert and the next `apply` starts from diffusers' own classes again. diffusers' module global is the truth
    for "patched?" (`is_patched`); this only knows what to put back."""

    def __init__(self) -> None:
        self.originals: dict[tuple[str, str], Any] = {}
        """(module name, attribute) -> the object the patch replaced (None: the attribute was absent)."""
        self.report: PatchReport | None = None
        """The report of the apply that replaced the globals; None when not patched."""

    def original(self, attribute: str) -> Any:
        """The object the patch replaced under `attribute` (in whichever module), or None."""
        return next((obj for (_, name), obj in self.originals.items() if name == attribute), None)

    def clear(self) -> None:
        self.originals.clear()
        self.report = None


STATE = PatchState()
