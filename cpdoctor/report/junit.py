"""The report as JUnit XML, the format CI systems (Jenkins, GitLab, GitHub Actions reporters, Azure) read:
one testcase per examined thing. PASS passes; FAIL is a <failure> with the diagnosis and the tensor table;
CRASH and HANG are <error>s with the traceback; UNSUPPORTED is <skipped> with the reason. The testcases are
those of the run the exit code speaks for (with --patch, the patched run; the unpatched verdict is in the
testcase's system-out)."""

from __future__ import annotations

import datetime
import socket
import xml.etree.ElementTree as ET

from cpdoctor.report.findings import Finding, Report
from cpdoctor.report.text import finding_text
from cpdoctor.report.verdict import Verdict

FAILURE_TAG = {Verdict.FAIL: "failure", Verdict.CRASH: "error", Verdict.HANG: "error"}


def _testcase(suite: ET.Element, command: str, finding: Finding, before: Finding | None) -> str | None:
    case = ET.SubElement(suite, "testcase", classname=f"cpdoctor.{command}", name=finding.subject, time="0")
    verdict = Verdict(finding.verdict)
    if verdict in FAILURE_TAG:
        body = finding_text(finding)
        if finding.remedy and "remedy:" not in body:
            body += f"\nremedy: {finding.remedy}"
        ET.SubElement(case, FAILURE_TAG[verdict], message=f"{verdict.value}: {finding.diagnosis}", type=verdict.value).text = body
    elif verdict is Verdict.UNSUPPORTED:
        ET.SubElement(case, "skipped", message=finding.diagnosis)
    if before is not None:
        ET.SubElement(case, "system-out").text = f"before the patch: {Verdict(before.verdict).value} — {before.diagnosis}"
    return FAILURE_TAG.get(verdict) or ("skipped" if verdict is Verdict.UNSUPPORTED else None)


def to_junit(report: Report, command: str) -> str:
    """The XML document (UTF-8 text) of `report`, produced by `cpdoctor <command>`."""
    root = ET.Element("testsuites", name="cpdoctor")
    suite = ET.SubElement(
        root,
        "testsuite",
        name=f"cpdoctor {command}",
        timestamp=datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
        hostname=socket.gethostname(),
        time=f"{report.wall_s:.3f}",
    )
    props = ET.SubElement(suite, "properties")
    for key, value in report.environment.to_jsonable().items():
        ET.SubElement(props, "property", name=key, value=str(value))
    befores = report.before.findings if report.before is not None else []
    counts = {"failure": 0, "error": 0, "skipped": 0}
    for i, finding in enumerate(report.findings):
        kind = _testcase(suite, command, finding, befores[i] if i < len(befores) else None)
        if kind is not None:
            counts[kind] += 1
    totals = {
        "tests": str(len(report.findings)),
        "failures": str(counts["failure"]),
        "errors": str(counts["error"]),
        "skipped": str(counts["skipped"]),
    }
    for element in (root, suite):
        element.attrib.update(totals)
    root.set("time", f"{report.wall_s:.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
