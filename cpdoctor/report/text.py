"""A finding as plain text (no colour, fixed width): the body of a JUnit failure and of a Markdown block."""

from __future__ import annotations

import io

from cpdoctor.report.findings import Finding
from cpdoctor.report.render import render_finding


def finding_text(finding: Finding, before: Finding | None = None, width: int = 130) -> str:
    """The table, the verdict line, diagnosis, remedy and tracebacks exactly as the terminal shows them."""
    from rich.console import Console

    buf = io.StringIO()
    render_finding(finding, before, Console(file=buf, width=width, color_system=None, highlight=False, soft_wrap=True))
    return buf.getvalue().rstrip()
