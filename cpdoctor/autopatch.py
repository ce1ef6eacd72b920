"""`import cpdoctor.autopatch` puts the fixed CP attention (ring and Ulysses) into diffusers when CPDOCTOR_PATCH=1.

Meant for training scripts you would rather not edit beyond one import (or a `sitecustomize`):

    CPDOCTOR_PATCH=1 torchrun ... train.py        # train.py does `import cpdoctor.autopatch`

It writes one line to stderr saying what it did. It never raises: a diffusers it does not recognise (or no
diffusers at all) is reported on that line and left untouched. `CPDOCTOR_PATCH=force` patches past the
recognition check (see cpdoctor.fix.patch.apply). Any other value does nothing, silently.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

ENV = "CPDOCTOR_PATCH"


class AutoPatch:
    """The patch this import hook applied. Lifetime: one instance, `AUTOPATCH`, created and run at this module's
    first import (Python imports a module once per process, so the hook runs once); `run` reads the environment,
    patches or not, and keeps the PatchReport (or None: not asked, or it failed). A second `run` (a test) does
    the same again; what the patch itself put aside is `cpdoctor.fix.patch.STATE`'s, not this object's."""

    def __init__(self) -> None:
        self.report: Any = None
        """The PatchReport of the patch applied at import, or None."""

    def run(self, environ: Mapping[str, str] = os.environ) -> None:
        self.report = None
        value = environ.get(ENV, "").strip().lower()
        if value not in ("1", "force"):
            return
        from cpdoctor.attempt import Attempt

        applied = Attempt.of(lambda: _apply(force=value == "force"))  # an import-time hook must not take the script down
        self.report = applied.value
        if applied.value is not None:
            print(applied.value.summary(), file=sys.stderr)
        else:
            print(f"cpdoctor: {ENV}={value} but diffusers' CP attention was NOT patched: {applied.error}", file=sys.stderr)


def _apply(force: bool) -> Any:
    """cpdoctor's fix patched in (fix/patch.py's `PatchReport`), its import included in what may fail."""
    from cpdoctor.fix import patch

    return patch.apply(force=force)


AUTOPATCH = AutoPatch()


def __getattr__(name: str) -> Any:
    """`cpdoctor.autopatch.report`: the PatchReport of the patch applied at import, or None (read from AUTOPATCH)."""
    if name == "report":
        return AUTOPATCH.report
    raise AttributeError(f"module 'cpdoctor.autopatch' has no attribute {name!r}")


AUTOPATCH.run()
