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

ENV = "CPDOCTOR_PATCH"

report = None
"""The PatchReport of the patch applied at import, or None."""


def _run() -> None:
    global report
    value = os.environ.get(ENV, "").strip().lower()
    if value not in ("1", "force"):
        return
    try:
        from cpdoctor.fix import patch

        report = patch.apply(force=value == "force")
        print(report.summary(), file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - an import-time hook must not take the training script down
        print(f"cpdoctor: {ENV}={value} but diffusers' CP attention was NOT patched: {exc}", file=sys.stderr)


_run()
