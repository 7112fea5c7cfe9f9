"""Docs that cannot rot: the site builds with ``mkdocs build --strict`` (a broken link or a page missing from the
nav fails it), every config key and metric name the README and docs mention exists, and the generated references
are current (tests/unit/test_config_reference.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_kl.config_reference import rows
from megatron_kl.train.config import TrainConfig
from megatron_kl.train.metric_registry import METRICS, lookup

ROOT = Path(__file__).resolve().parents[2]
GENERATED = {"configuration.md", "metrics.md"}  # their keys are the registries themselves (tested current)
WRITTEN = [ROOT / "README.md", ROOT / "launch" / "README.md"] + sorted(
    p for p in (ROOT / "docs").glob("*.md") if p.name not in GENERATED
)

_CODE = re.compile(r"`([^`\n]+)`")
_BLOCK = re.compile(r"^(?: {4}|\t)(.*)$|```[a-z]*\n(.*?)```", re.M | re.S)


def _code_text(text: str) -> list[str]:
    """Inline code spans and the lines of code blocks (indented or fenced)."""
    spans = _CODE.findall(text)
    for indented, fenced in _BLOCK.findall(text):
        spans += (indented or fenced).split()
    return spans


def _expand(token: str) -> list[str]:
    """``a.{b,c}`` -> a.b, a.c; ``x/mean|max`` -> x/mean, x/max; ``x_{min,max}`` likewise."""
    brace = re.search(r"\{([^{}]*)\}", token)
    if brace:
        return [
            e
            for alt in brace.group(1).split(",")
            for e in _expand(token[: brace.start()] + alt.strip() + token[brace.end() :])
        ]
    first, *others = token.split("|")
    cut = max(first.rfind("_"), first.rfind("/"), first.rfind(".")) + 1
    return [first] + [first[:cut] + alt for alt in others]


SECTIONS = {path.split(".")[0] for path, *_ in rows(TrainConfig)}
_KEY = re.compile(
    r"(?<![\w/.$-])((?:%s)(?:\.[a-z_][a-z0-9_]*|\.\{[a-z0-9_, ]+\})+(?:\|[a-z0-9_]+)*)(?![\w(/-])"
    % "|".join(sorted(SECTIONS))
)
_FILE = re.compile(r"\.(py|yaml|md|json|jsonl|pt|txt|png|sh|gz|parquet)$")


def config_paths() -> tuple[set[str], set[str]]:
    """Every field path and section prefix of the training config; dict-valued fields (any subkey allowed)."""
    paths, dicts = set(), set()
    for path, type_name, *_ in rows(TrainConfig):
        parts = path.split(".")
        paths.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        if type_name.startswith("dict"):
            dicts.add(path)
    return paths, dicts


def mentioned_config_keys(text: str) -> set[str]:
    keys = set()
    for span in _code_text(text):
        for match in _KEY.finditer(span):
            if not _FILE.search(match.group(1)):
                keys.update(_expand(match.group(1)))
    return keys


def unknown_config_keys(text: str) -> set[str]:
    paths, dicts = config_paths()
    return {k for k in mentioned_config_keys(text) if k not in paths and not any(k.startswith(d + ".") for d in dicts)}


FAMILIES = {m.key.split("/")[0] for m in METRICS if "/" in m.key}
_METRIC = re.compile(r"^(?:%s)/[A-Za-z0-9_@:{},|.]+$" % "|".join(sorted(FAMILIES)))


def mentioned_metrics(text: str) -> set[str]:
    out = set()
    for span in _CODE.findall(text):
        token = re.split(r"=|: | ", span.strip())[0]
        if _METRIC.match(token) and not _FILE.search(token) and "..." not in token:
            out.update(_expand(token))
    return out


def test_every_config_key_the_docs_mention_exists():
    found = {}
    for path in WRITTEN:
        unknown = unknown_config_keys(path.read_text())
        if unknown:
            found[str(path.relative_to(ROOT))] = sorted(unknown)
    assert not found, f"config keys in the docs that the config does not have: {found}"
    assert len(set().union(*(mentioned_config_keys(p.read_text()) for p in WRITTEN))) > 50  # the scan sees them


def test_every_metric_the_docs_mention_is_registered():
    found = {}
    for path in WRITTEN:
        unknown = {m for m in mentioned_metrics(path.read_text()) if lookup(m) is None}
        if unknown:
            found[str(path.relative_to(ROOT))] = sorted(unknown)
    assert not found, f"metric keys in the docs that the trainer does not log: {found}"
    assert len(set().union(*(mentioned_metrics(p.read_text()) for p in WRITTEN))) > 20


def test_the_scanners_catch_planted_mistakes():
    text = (
        "Set `kl.coeff=0.1` or `rollout.sampling.{top_p,topk}`; read `kl/exact_tokens` and "
        "`staleness/mean|maximum`; `launch.env.ANY_NAME` and `megatron_kl/kl/objective.py` are fine.\n\n"
        "    megatron-kl train --config configs/cpu/default.yaml train.stpes=3\n"
    )
    assert unknown_config_keys(text) == {"kl.coeff", "rollout.sampling.topk", "train.stpes"}
    assert {m for m in mentioned_metrics(text) if lookup(m) is None} == {"kl/exact_tokens", "staleness/maximum"}


PROCESS_TEXT = re.compile(r"(?<![\w&])#\d{1,3}\b(?!\w)|\bissue #?\d+|\blent\b", re.I)


def test_no_process_text_in_what_users_read():
    """No issue numbers and no words about who lent a machine in the README, docs, CLI help or comments."""
    planted = ["the targets of #19", "see issue 31", "no GPU was lent to this task"]
    assert all(PROCESS_TEXT.search(line) for line in planted)
    assert not PROCESS_TEXT.search("`#SBATCH --signal=USR1@300`, colour #fff, step 10 of 60")
    pattern = PROCESS_TEXT
    hits = []
    code = [
        *(ROOT / "megatron_kl").rglob("*.py"),
        *(ROOT / "launch").glob("*.py"),
        *(ROOT / "tools").glob("*.py"),
        *(ROOT / "configs").rglob("*.yaml"),
        *(ROOT / "scripts").glob("*.sh"),
        ROOT / "setup.py",
        ROOT / "mkdocs.yml",
    ]
    for path in [*WRITTEN, *code]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line) and "noqa" not in line:
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits)


def _mkdocs(directory: Path, site: Path) -> subprocess.CompletedProcess:
    # not -q: mkdocs counts the warnings that strict mode turns into a failure from its log, which -q silences
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


def test_the_docs_site_builds_strictly_and_a_broken_link_fails_it(tmp_path):
    built = _mkdocs(ROOT, tmp_path / "site")
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "index.html").read_text().count("kl_shaped_returns") > 0  # mkdocstrings ran
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy)
    (copy / "megatron_kl").symlink_to(ROOT / "megatron_kl")
    with open(copy / "docs" / "training.md", "a") as f:
        f.write("\nSee [the missing page](no-such-page.md).\n")
    broken = _mkdocs(copy, tmp_path / "site2")
    assert broken.returncode != 0 and "no-such-page.md" in broken.stdout + broken.stderr


def _code_tour():
    import importlib.util

    spec = importlib.util.spec_from_file_location("code_tour", ROOT / "tools" / "code_tour.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_code_tour_is_current_and_names_every_file():
    """docs/code-tour.md is generated from the files' own docstrings: `python tools/code_tour.py >
    docs/code-tour.md`."""
    tour = _code_tour()
    text = (ROOT / "docs" / "code-tour.md").read_text()
    assert text == tour.tour(), "docs/code-tour.md is stale: python tools/code_tour.py > docs/code-tour.md"
    for path in sorted((ROOT / "megatron_kl").rglob("*.py")) + sorted((ROOT / "tools").glob("*.py")):
        if path.name != "__init__.py":
            assert f"| `{path.name}` |" in text, path
    assert tour.summary("Gradients w.r.t. the hidden states. More.") == "Gradients w.r.t. the hidden states."


def test_a_file_without_a_docstring_stops_the_code_tour(tmp_path, monkeypatch):
    tour = _code_tour()
    package = tmp_path / "megatron_kl"
    package.mkdir()
    (package / "documented.py").write_text('"""What it is. More."""\n')
    (package / "silent.py").write_text("x = 1\n")
    monkeypatch.setattr(tour, "ROOT", tmp_path)
    monkeypatch.setattr(tour, "PACKAGE", package)
    monkeypatch.setattr(tour, "BESIDE", ())
    with pytest.raises(SystemExit, match="silent.py has no module docstring"):
        tour.tour()


def test_the_python_blocks_marked_run_run():
    """A fenced python block after ``<!-- run -->`` in docs/ runs as it is, in a fresh interpreter."""
    import subprocess
    import sys

    blocks = [
        (page.name, code)
        for page in sorted((ROOT / "docs").glob("*.md"))
        for code in re.findall(r"<!-- run -->\s*```python\n(.*?)```", page.read_text(), re.S)
    ]
    assert blocks, "no runnable block found"
    for page, code in blocks:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{page}:\n{code}\n{done.stderr[-2000:]}"


def test_the_python_example_in_your_own_job_is_the_tested_file():
    text = (ROOT / "docs" / "your-own-job.md").read_text()
    block = re.search(r"examples/train_from_python.py from .*?-->\s*```python\n(.*?)```", text, re.S).group(1)
    source = (ROOT / "examples" / "train_from_python.py").read_text()
    assert block == source[source.index("from megatron_kl import api") :]
