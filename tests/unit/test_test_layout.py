"""The test suite's own layout: the README's test command works on a fresh clone and CI runs exactly it.

pytest refuses two test modules of one basename in folders that are not packages ("import file mismatch"), which
stopped the README's second command after 5 s while CI, running the tiers separately, never saw it (issue 28).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"


def test_no_two_test_modules_share_a_basename():
    seen: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name.startswith("test_") or path.name == "conftest.py":
            seen[path.name].append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a basename (pytest refuses them in one run): {clashes}"


def readme_test_command() -> str:
    """The pytest invocation of the README's second command (set up and run the tests)."""
    block = README.read_text().split("```bash", 1)[1].split("```", 1)[0]
    setup = [line for line in block.splitlines() if "pytest" in line and not line.lstrip().startswith("#")]
    assert len(setup) == 1, "the README's first block should hold exactly one command that runs the tests"
    command = setup[0].split("&&")[-1].strip()
    assert command.endswith("-m pytest -q"), command
    return command


def test_ci_runs_the_readme_test_command_in_words():
    """CI runs the README's own words (its environments differ in packages, and the full tier is a variable it
    exports, not another command)."""
    command = readme_test_command()
    text = CI.read_text()
    runs = [line.strip() for line in text.splitlines() if "pytest" in line and not line.lstrip().startswith("#")]
    assert runs, ".ci/run runs no tests"
    invocation = re.compile(r"(^|[\s!;(])" + re.escape(command) + r"($|\s*[;)&|])")  # the command, nothing added to it
    assert all(invocation.search(line) for line in runs), f".ci/run runs tests otherwise than the README's `{command}`: {runs}"
    assert "export CPDOCTOR_TESTS=full" in text, ".ci/run must run the full integration tier"
    environments = re.findall(r"^tests (\S+)$", text, re.M)
    assert any("0.42" in e for e in environments) and any("0.39" in e for e in environments), environments


def test_the_fast_tier_covers_every_verdict_kind_and_wing():
    """The smoke set (docs/TESTS.md): one check per verdict kind, the patch, one model, one step, one peer."""
    marked = {}
    for path in (TESTS / "integration").glob("test_*.py"):
        text = path.read_text()
        marked[path.name] = re.findall(r"@pytest\.mark\.smoke\s*\n(?:@[^\n]*\n)*def (test_\w+)", text)
    wanted = {
        "test_doctor.py": "PASS and FAIL on diffusers' ring and Ulysses, and every installed peer",
        "test_launch.py": "CRASH and HANG",
        "test_cli.py": "UNSUPPORTED and bad input",
        "test_suite.py": "the patch",
        "test_model.py": "one model",
        "test_step_command.py": "one step",
    }
    missing = {name: why for name, why in wanted.items() if not marked.get(name)}
    assert not missing, f"the fast tier lost its smoke test for: {missing}"
