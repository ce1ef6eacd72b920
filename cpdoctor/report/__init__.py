"""What every examination returns and the user sees (the bottom layer: it imports nothing of cpdoctor's but
errors): Verdict and ExitCode (`verdict.py`), where it ran (`environment.py`), typed numbers (`numbers.py`), Finding / RunResult / Report
(`findings.py`), the one serialiser to JSON-ready data (`serialize.py`), rich rendering (`render.py`), and the
documents that travel: JUnit (`junit.py`), Markdown (`markdown.py`), plain text (`text.py`)."""

from __future__ import annotations

from cpdoctor.report.environment import Environment
from cpdoctor.report.findings import Asked, FailureEvidence, Finding, Report, RunResult
from cpdoctor.report.numbers import BlockRow, Comparison, JudgedRow, ParamRow, TensorRow
from cpdoctor.report.render import TENSOR_LABELS, environment_line, fmt, render, render_finding, styled, tensor_table, worst_tensor
from cpdoctor.report.verdict import SEVERITY, ExitCode, Verdict, overall

__all__ = [
    "SEVERITY",
    "Asked",
    "TENSOR_LABELS",
    "BlockRow",
    "Comparison",
    "Environment",
    "ExitCode",
    "FailureEvidence",
    "Finding",
    "JudgedRow",
    "ParamRow",
    "Report",
    "RunResult",
    "TensorRow",
    "Verdict",
    "environment_line",
    "fmt",
    "overall",
    "render",
    "render_finding",
    "styled",
    "tensor_table",
    "worst_tensor",
]
