"""Every measured figure README.md, benchmarks/README.md and docs/MODELS.md quote is the value of a stored run, so a figure cannot
drift from its run: benchmarks/figures.yaml says which JSON value each figure is (the convention is written in
benchmarks/README.md, "Figures and their runs"); this test renders each entry from the JSON and fails when the
document does not print it, when the section does not name the results file, or when a results file a document
names does not exist. A results file a figure comes from either records its provenance (machine, versions, load
average, repetitions ≥ 5, spread) or is listed in benchmarks/README.md as stored before this convention."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
DOCS = ("README.md", "benchmarks/README.md", "docs/MODELS.md")
BEFORE_HEADING = "### Stored before this convention"
_ROW = re.compile(r"^(\w+)\[(.*)\]$")
_NAMED = re.compile(r"results/[A-Za-z0-9_.\-]+\.(?:json|diff)")


def _flat(text: str) -> str:
    """Whitespace collapsed: a sentence matches however the document wraps its lines."""
    return re.sub(r"\s+", " ", text)


def resolve(data, path: str):
    """The value at `path`: keys and list indexes joined by dots, `key[k=v,...]` picking the one row of a list
    whose fields match, then optional `|min`, `|max`, `|median` over a list."""
    path, *reducers = path.split("|")
    value = data
    for part in path.split("."):
        row = _ROW.match(part)
        if row:
            wanted = dict(kv.split("=", 1) for kv in row.group(2).split(","))
            rows = [r for r in value[row.group(1)] if all(str(r.get(k)) == v for k, v in wanted.items())]
            if len(rows) != 1:
                raise KeyError(f"{part}: {len(rows)} rows match, need exactly 1")
            value = rows[0]
        elif isinstance(value, list):
            value = value[int(part)]
        else:
            value = value[part]
    for reducer in reducers:
        value = {"min": min, "max": max, "median": statistics.median}[reducer](value)
    return value


def render(value, fmt: str) -> str:
    """The value as the documents print it: a Python format spec, exponents without padding (2.7e-7)."""
    text = format(value, fmt)
    return re.sub(r"e([+-])0*(\d)", lambda m: "e" + ("-" if m.group(1) == "-" else "") + m.group(2), text)


def _sections(doc: str) -> list[tuple[str, str]]:
    """The Markdown sections (a heading of any level to the next), whitespace collapsed, each with the text
    that names its files: its own and that of every heading above it (a `##` covers its `###`s)."""
    fences = [m.span() for m in re.finditer(r"^(````|```).*?^\1", doc, flags=re.M | re.S)]
    heads = [m for m in re.finditer(r"^(#{1,6}) ", doc, flags=re.M) if not any(a < m.start() < b for a, b in fences)]
    marks = [(0, 0)] + [(m.start(), len(m.group(1))) for m in heads]
    marks.append((len(doc), 0))
    out, chain = [], []  # chain: (level, text) of the headings enclosing the current one
    for (a, level), (b, _) in zip(marks, marks[1:]):
        text = _flat(doc[a:b])
        chain = [c for c in chain if c[0] < level] if level else []
        chain.append((level, text))
        out.append((text, " ".join(t for _, t in chain)))
    return out


def check(docs: dict[str, str], figures: list[dict], bench: Path) -> list[str]:
    """Every disagreement between the documents and the stored runs, one line each (empty: all agree)."""
    problems = []
    for doc_name, text in docs.items():
        for named in sorted(set(_NAMED.findall(text))):
            if not (bench / named).is_file():
                problems.append(f"{doc_name} names {named}, which does not exist in benchmarks/")
    for entry in figures:
        doc_name, default = entry["doc"], entry["results"]
        used, rendered = {default}, {}
        try:
            for name, spec in entry["values"].items():
                where, fmt = spec.rsplit(" ", 1)
                file, path = where.split("#", 1) if "#" in where else (default, where)
                file = file if file.startswith("results/") else f"results/{file}"
                used.add(file)
                if not (bench / file).is_file():
                    raise FileNotFoundError(f"benchmarks/{file} does not exist")
                rendered[name] = render(resolve(json.loads((bench / file).read_text()), path), fmt)
        except (FileNotFoundError, KeyError, IndexError, ValueError, TypeError) as exc:
            problems.append(f"{doc_name}: {entry['text'][:60]!r}: no such value in the results: {exc!r}")
            continue
        want = _flat(entry["text"].format(**rendered))
        section = next((names for s, names in _sections(docs[doc_name]) if want in s), None)
        if section is None:
            problems.append(f"{doc_name} does not say what its run says: expected {want!r}")
            continue
        for file in sorted(used):
            if file not in section:
                problems.append(f"{doc_name}: the section quoting {want[:50]!r} does not name {file}")
    return problems


def _provenance_missing(data: dict) -> list[str]:
    """What a results file lacks of the convention's record (empty: it has it all)."""
    runs = data.get("runs", [])
    loads = "load_average" in data or any("load_average" in r for r in runs)
    rows = data.get("rows", [])
    rows = list(rows.values()) if isinstance(rows, dict) else rows  # rows by name (commands_*.json) or a list
    reps = [data.get("reps")] + [r.get("reps") for r in runs + rows]
    reps = [r for r in reps if isinstance(r, int)]
    has = {
        "machine (CPU model)": "cpu_model" in data.get("machine", {}),
        "versions": "versions" in data or {"torch", "diffusers"} <= set(data),
        "load average": loads,
        # a seeded examination's error is a fixed number: its script shows that by running a case twice
        "repetitions ≥ 5 (or deterministic)": (bool(reps) and min(reps) >= 5) or data.get("deterministic") is True,
        "spread": "spread" in json.dumps(data),
    }
    return [name for name, ok in has.items() if not ok]


def _stored_before(bench_readme: str) -> set[str]:
    """The results files benchmarks/README.md lists as stored before this convention."""
    section = next((s for s, _ in _sections(bench_readme) if s.startswith(BEFORE_HEADING)), "")
    return set(_NAMED.findall(section))


@pytest.fixture(scope="module")
def docs() -> dict[str, str]:
    return {name: (ROOT / name).read_text() for name in DOCS}


@pytest.fixture(scope="module")
def figures() -> list[dict]:
    return yaml.safe_load((BENCH / "figures.yaml").read_text())


def test_every_mapped_figure_is_its_stored_value(docs, figures):
    assert figures, "benchmarks/figures.yaml maps no figure"
    assert check(docs, figures, BENCH) == []


def test_a_results_file_records_its_run_or_is_listed_as_older(docs, figures):
    listed = _stored_before(docs["benchmarks/README.md"])
    used = {e["results"] for e in figures} | {
        ("results/" + s.split("#")[0]) for e in figures for s in e["values"].values() if "#" in s.split(" ")[0]
    }
    problems = []
    for file in sorted(used):
        missing = _provenance_missing(json.loads((BENCH / file).read_text()))
        if missing and file not in listed:
            problems.append(f"{file} lacks {', '.join(missing)} and is not listed under {BEFORE_HEADING!r}")
    assert problems == []


def test_a_planted_drift_is_reported(docs, figures):
    entry = next(e for e in figures if e["results"] == "results/ring_cpu.json" and e["doc"] == "README.md")
    x = render(resolve(json.loads((BENCH / entry["results"]).read_text()), "rows[world=4,seq=16384,dtype=fp32].patched_memory_x"), ".3f")
    drifted = dict(docs)
    assert check(drifted, [entry], BENCH) == []
    flat = _flat(drifted["README.md"])
    assert x + " /" in flat
    drifted["README.md"] = flat.replace(x + " /", "0.499 /", 1)
    problems = check(drifted, [entry], BENCH)
    assert len(problems) == 1 and "does not say what its run says" in problems[0]


def test_a_missing_results_file_is_reported(docs, tmp_path):
    drifted = {"README.md": docs["README.md"] + "\nsee `benchmarks/results/never_run.json`\n"}
    problems = check(drifted, [], BENCH)
    assert problems == ["README.md names results/never_run.json, which does not exist in benchmarks/"]
    entry = {"doc": "README.md", "results": "results/never_run.json", "text": "{a}", "values": {"a": "x .1f"}}
    assert "does not exist" in check({"README.md": ""}, [entry], BENCH)[0]


def test_a_figure_whose_section_does_not_name_its_file_is_reported():
    rows = json.loads((BENCH / "results" / "ring_cpu.json").read_text())["rows"]
    stored = next(r for r in rows if (r["world"], r["seq"], r["dtype"]) == (4, 16384, "fp32"))["patched_memory_x"]
    doc = f"# A\n\nresults/ring_cpu.json\n\n# B\n\nwe measured {stored:.3f} here\n"
    entry = {
        "doc": "README.md",
        "results": "results/ring_cpu.json",
        "text": "measured {x} here",
        "values": {"x": "rows[world=4,seq=16384,dtype=fp32].patched_memory_x .3f"},
    }
    problems = check({"README.md": doc}, [entry], BENCH)
    assert len(problems) == 1 and "does not name results/ring_cpu.json" in problems[0]
    assert check({"README.md": doc.replace("# B\n", "")}, [entry], BENCH) == []
    assert check({"README.md": doc.replace("# B\n", "## B\n")}, [entry], BENCH) == []  # named by the heading above


def test_render_prints_as_the_documents_do():
    assert render(2.7409723629500027e-07, ".1e") == "2.7e-7"
    assert render(3.0e12, ".1e") == "3.0e12"
    assert render(0.502538923944293, ".3f") == "0.503"


def test_a_results_file_without_its_record_is_named():
    full = {
        "machine": {"cpu_model": "AMD EPYC"},
        "versions": {"torch": "2.13.0"},
        "load_average": {"before": [1.0, 1.0, 1.0]},
        "reps": 5,
        "median_spread": [1.0, 2.0],
    }
    assert _provenance_missing(full) == []
    assert _provenance_missing({**full, "reps": 2}) == ["repetitions ≥ 5 (or deterministic)"]
    assert _provenance_missing({**full, "reps": 1, "deterministic": True}) == []
    assert len(_provenance_missing({})) == 5
    listed = _stored_before("# B\n\n### Stored before this convention\n\n- `results/old.json`: no load\n\n## C\nresults/x.json\n")
    assert listed == {"results/old.json"}
