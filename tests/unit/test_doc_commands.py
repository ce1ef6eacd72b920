"""Every command line the documents show is one the code accepts: README.md and docs/*.md name `cpdoctor`
commands, their options and the shipped suites, and each such claim is read back against the Typer app itself
(the command exists, every `--option` is one of that command's, `cpdoctor run NAME` is a shipped suite). A
document that names an option the code dropped, or a command that was renamed, fails here instead of misleading
a newcomer. Figures are checked the same way against their stored runs (test_readme_figures.py)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer.main

from cpdoctor.cli import app

ROOT = Path(__file__).resolve().parents[2]
SUITES = ROOT / "cpdoctor" / "suites"
_FENCE = re.compile(r"^(```+)([^`\n]*)\n(.*?)^\1[ \t]*$", re.M | re.S)
_SHELL = {"", "bash", "sh", "shell", "console"}
"""Fenced blocks whose lines are command lines (an ISSUE.md shown as ```markdown, a diff or Python are not)."""
_SPAN = re.compile(r"`([^`\n]+)`")
_STOP = {"|", "||", "&&", ";", "#", ">", "2>&1", "&"}
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$|^<.*>$|^\[.*\]$|^\.\.\.$|^…$")


def documents() -> dict[str, str]:
    """README.md and every page under docs/ (FACTS.md included: its commands are claims too)."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in paths}


@dataclass(frozen=True)
class Mention:
    """One `cpdoctor ...` command line as a document prints it."""

    doc: str
    line: int
    words: tuple[str, ...]  # after `cpdoctor`, up to the end of the command (a pipe, a comment, `--` and its command)

    def where(self) -> str:
        return f"{self.doc}:{self.line}: cpdoctor {' '.join(self.words)}"


def _split(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=False)
    except ValueError:  # an unbalanced quote in prose: words as printed
        return text.split()


def _command_words(tokens: list[str]) -> list[tuple[str, ...]]:
    """Each `cpdoctor` (or `-m cpdoctor`) in a token list and the words that belong to it."""
    found = []
    for i, tok in enumerate(tokens):
        if tok not in ("cpdoctor", ".venv/bin/cpdoctor"):
            continue
        words = []
        for word in tokens[i + 1 :]:
            if word in _STOP or word.startswith("#") or word == "--":
                break  # a shell operator, a comment, or `--` before the user's own command (`cpdoctor step -- ...`)
            words.append(word)
        found.append(tuple(words))
    return found


def mentions(doc: str, text: str) -> list[Mention]:
    """The command lines in fenced blocks (one per line, `$ ` prompts dropped) and in inline code spans."""
    out: list[Mention] = []
    fenced = [(m.start(3), m.group(3)) for m in _FENCE.finditer(text) if m.group(2).strip() in _SHELL]
    for start, block in fenced:
        first = text.count("\n", 0, start) + 1
        transcript = any(line.startswith("$ ") for line in block.splitlines())  # then the other lines are output
        for k, line in enumerate(block.splitlines()):
            if transcript and not line.startswith("$ "):
                continue
            line = line.strip().removeprefix("$ ")
            for words in _command_words(_split(line)):
                out.append(Mention(doc, first + k, words))
    outside = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for m in _SPAN.finditer(outside):
        for words in _command_words(_split(m.group(1))):
            out.append(Mention(doc, outside.count("\n", 0, m.start()) + 1, words))
    return out


def _options(command: Any) -> set[str]:
    """A click command's long options (typer vendors its own click: read by attribute, not by class)."""
    names = {"--help"}
    for param in command.params:
        names.update(o for o in (*param.opts, *getattr(param, "secondary_opts", ())) if o.startswith("--"))
    return names


def problems(found: list[Mention], group: Any, suites: set[str]) -> list[str]:
    """Each mention the code would refuse, one line each (empty: the documents and the code agree)."""
    bad = []
    for m in found:
        words = list(m.words)
        command = group
        if words and not words[0].startswith("-") and not _PLACEHOLDER.match(words[0]):
            if words[0] not in group.commands:
                bad.append(f"{m.where()}: no command {words[0]!r}")
                continue
            command = group.commands[words.pop(0)]
        known = _options(command)
        for word in words:
            if word.startswith("--"):
                name = word.split("=", 1)[0]
                if name not in known:
                    bad.append(f"{m.where()}: {command.name or 'cpdoctor'} has no option {name}")
        if command.name == "run" and words and not words[0].startswith("-"):
            suite = words[0]
            if "/" not in suite and not suite.endswith((".yaml", ".yml")) and not _PLACEHOLDER.match(suite) and suite not in suites:
                bad.append(f"{m.where()}: no shipped suite {suite!r} (shipped: {', '.join(sorted(suites))})")
    return bad


def _group() -> Any:
    """The app as click sees it: `commands` maps each name to its command."""
    return typer.main.get_command(app)


def test_every_documented_command_line_is_accepted_by_the_code() -> None:
    suites = {p.stem for p in SUITES.glob("*.yaml")}
    found = [m for doc, text in documents().items() for m in mentions(doc, text)]
    assert len(found) > 20, "the documents name cpdoctor's commands; the reader found almost none"
    bad = problems(found, _group(), suites)
    assert not bad, "the documents show command lines the code refuses:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("`cpdoctor check --ring 2 --no-such-option`", "check has no option --no-such-option"),
        ("```\n$ cpdoctor chekc --ring 2\n```\n", "no command 'chekc'"),
        ("`cpdoctor run no-such-suite`", "no shipped suite 'no-such-suite'"),
        ("`cpdoctor --patch --bogus`", "cpdoctor has no option --bogus"),
    ],
)
def test_the_reader_catches_a_planted_stale_claim(text: str, expected: str) -> None:
    bad = problems(mentions("planted.md", text), _group(), {"quick"})
    assert len(bad) == 1 and expected in bad[0], bad


@pytest.mark.parametrize(
    "text",
    [
        "`cpdoctor check --ring 2 --patch`",
        "```\ntorchrun --nproc-per-node 4 -m cpdoctor check --ring 2 --ulysses 2    # joins torchrun's world\n```\n",
        "`cpdoctor run quick --json -`",
        "`cpdoctor step -- torchrun --nproc-per-node {nproc} train.py --bogus-flag-of-the-user`",
        "`cpdoctor.patch()` and `cpdoctor check --help`",
    ],
)
def test_the_reader_accepts_what_the_code_accepts(text: str) -> None:
    assert problems(mentions("ok.md", text), _group(), {"quick"}) == []
