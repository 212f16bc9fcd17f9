"""The docs a user reads: no dead link or anchor, no command that would not parse, no word about how
the project was made.

Two checks of links and anchors. `mkdocs build --strict` (mkdocs.yml) builds docs/ as a site and fails
on a link to a missing page or a missing #anchor between pages. The pages are also read on GitHub,
whose heading anchors differ from mkdocs' in places, and README.md lies outside docs/: this file's
own pass reads every link of README.md, CHANGELOG.md and docs/ with markdown-it-py (the CommonMark
parser, so links inside code are not links) and resolves anchors by GitHub's slug rules. Each check
has a negative control that plants a dead link and a dead anchor and requires both to be reported.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import unicodedata
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    p for p in [ROOT / "README.md", ROOT / "CHANGELOG.md", *ROOT.glob("docs/**/*.md"),
                *ROOT.glob("examples/*/README.md")] if p.is_file()
)
# The pages a deployer copies commands from: every command shown there must parse.
COMMAND_PAGES = [ROOT / "README.md", ROOT / "docs" / "deploying.md"]
_MD = MarkdownIt("commonmark", {"html": True}).enable("table")


def _inline_text(token) -> str:
    return "".join(c.content for c in token.children or () if c.type in ("text", "code_inline", "html_inline"))


def slug(text: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped (letters, digits, `-`, `_` and
    spaces kept), each space a hyphen."""
    text = text.strip().lower()
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return kept.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    tokens = _MD.parse(page.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for i, tok in enumerate(tokens):
        if tok.type == "heading_open":
            base = slug(_inline_text(tokens[i + 1]))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
        for m in re.finditer(r"<a\s+(?:id|name)=\"([^\"]+)\"", tok.content or ""):
            out.add(m.group(1))
    return frozenset(out)


def links(page: Path) -> list[str]:
    out = []
    for tok in _MD.parse(page.read_text(encoding="utf-8")):
        for child in tok.children or ():
            if child.type == "link_open":
                out.append(child.attrs["href"])
            elif child.type == "image":
                out.append(child.attrs["src"])
    return out


def dead_links(page: Path) -> list[str]:
    """Every relative link of the page whose file, or whose #anchor in a Markdown file, is missing."""
    dead = []
    for href in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", href):  # https:, mailto: ...: not ours to check
            continue
        path, _, anchor = href.partition("#")
        target = (page.parent / unquote(path)).resolve() if path else page
        if not target.exists():
            dead.append(f"{href}: no file {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}")
        elif anchor and target.suffix == ".md" and unquote(anchor) not in anchors(target):
            dead.append(f"{href}: no heading with anchor #{anchor} in {target.name}")
    return dead


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_dead_link_or_anchor(page: Path) -> None:
    assert dead_links(page) == []


def test_the_check_reports_a_dead_link_and_a_dead_anchor(tmp_path: Path) -> None:
    """Negative control: a renamed file and a renamed section must both be caught."""
    (tmp_path / "other.md").write_text("# A title\n\n## Settings that matter\n\n## Settings that matter\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[fine](other.md#settings-that-matter) [second](other.md#settings-that-matter-1) [self](#page)\n"
        "[gone](missing.md) [renamed](other.md#settings) [self gone](#nowhere)\n"
        "`[in code](missing-too.md)` [web](https://example.com/x#y)\n"
    )
    dead = dead_links(page)
    assert len(dead) == 3, dead
    assert dead[0].startswith("missing.md") and "#settings" in dead[1] and "#nowhere" in dead[2]


def _mkdocs_strict(root: Path, site: Path) -> subprocess.CompletedProcess:
    # never --quiet: it hides the warnings that --strict counts, and a dead link would pass
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=root, capture_output=True, text=True, timeout=300)


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    out = _mkdocs_strict(ROOT, tmp_path / "site")
    assert "No module named mkdocs" not in out.stderr, "mkdocs is pinned in requirements/cpu-lock.txt: run `make venv`"
    assert out.returncode == 0, out.stdout + out.stderr


def test_mkdocs_strict_fails_on_a_dead_link_and_anchor(tmp_path: Path) -> None:
    """Negative control: the same build over a copy of docs/ with a dead link and a dead anchor."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "deploying.md", "a") as f:
        f.write("\n[gone](missing-page.md) [renamed](serving.md#no-such-section)\n")
    out = _mkdocs_strict(tmp_path, tmp_path / "site")
    assert out.returncode != 0
    assert "missing-page.md" in out.stderr and "no-such-section" in out.stderr, out.stderr


def test_slug_follows_github() -> None:
    assert slug("Issue #18's targets (re-targeted to this machine's limit)") == \
        "issue-18s-targets-re-targeted-to-this-machines-limit"
    assert slug("1. Mamba2 B/C columns with n_groups = 1 < TP: wrong bytes (5 scenarios)") == \
        "1-mamba2-bc-columns-with-n_groups--1--tp-wrong-bytes-5-scenarios"
    assert slug("Headline (quick run, docs/performance-quick.json)") == "headline-quick-run-docsperformance-quickjson"


def test_no_page_speaks_of_how_the_project_was_made() -> None:
    """Dates, commits and machines say when a figure holds; work sessions say nothing to a user."""
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in PAGES
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if re.search(r"\bsessions?\b", line, re.IGNORECASE)]
    assert hits == []


# ---- commands shown to a deployer ----------------------------------------------------------------


def shell_commands(page: Path) -> list[str]:
    """The commands of a page's bash code blocks, continuation lines joined, comments dropped."""
    out = []
    for tok in _MD.parse(page.read_text(encoding="utf-8")):
        if tok.type != "fence" or tok.info.strip() not in ("bash", "sh", "shell", "console"):
            continue
        text = re.sub(r"\\\n\s*", " ", tok.content)
        for line in text.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                out.append(words)
    return out


def _nixlkv_args(words: list[str]) -> list[str] | None:
    if Path(words[0]).name == "nixlkv":
        return words[1:]
    return None


def _make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))


@pytest.mark.parametrize("page", COMMAND_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_shown_parses(page: Path) -> None:
    """Each `nixlkv ...`, `make ...`, proxy and `vllm serve --kv-transfer-config` line of the page is
    accepted by the parser, Makefile or configuration that would run it."""
    from nixlkv.cli import build_parser
    from nixlkv.serving import proxy
    from nixlkv.vllm.config import ConnectorConfig

    commands = shell_commands(page)
    assert commands, f"{page.name} shows no command"
    seen = set()
    for words in commands:
        if (args := _nixlkv_args(words)) is not None:
            build_parser().parse_args(args)  # SystemExit on an unknown command or flag
            seen.add("nixlkv")
        elif words[0] == "make":
            assert set(words[1:]) <= _make_targets(), words
            seen.add("make")
        elif words[:3] == ["python", "-m", "nixlkv.serving.proxy"]:
            proxy.build_parser().parse_args(words[3:])
            seen.add("proxy")
        elif words[:2] == ["vllm", "serve"]:
            cfg = json.loads(words[words.index("--kv-transfer-config") + 1])
            assert cfg["kv_connector"] == "NixlkvConnector" and cfg["kv_connector_module_path"] == "nixlkv.connector"
            assert cfg["kv_role"] in ("kv_producer", "kv_consumer", "kv_both")
            ConnectorConfig.parse(cfg.get("kv_connector_extra_config"), env={})
            seen.add("vllm")
        else:
            pytest.fail(f"{page.name}: a command this test does not know how to check: {shlex.join(words)}")
    assert {"nixlkv", "vllm", "proxy"} <= seen


def test_every_nixlkv_command_in_the_docs_parses() -> None:
    """Every `nixlkv ...` line of any page's code blocks (also `.venv/bin/nixlkv`, `$ nixlkv`) is
    accepted by the CLI: a renamed flag cannot stay in a page."""
    from nixlkv.cli import build_parser

    bad, count = [], 0
    for page in PAGES:
        for tok in _MD.parse(page.read_text(encoding="utf-8")):
            if tok.type != "fence":
                continue
            for line in re.sub(r"\\\n\s*", " ", tok.content).splitlines():
                line = line.strip().removeprefix("$ ")
                if not re.match(r"^(\S*/)?nixlkv\s", line):
                    continue
                count += 1
                try:
                    build_parser().parse_args(shlex.split(line, comments=True)[1:])
                except SystemExit:
                    bad.append(f"{page.relative_to(ROOT)}: {line}")
    assert count > 20 and bad == []


def test_readme_figures_are_those_of_the_committed_json() -> None:
    """The README's measured table quotes docs/comparison.json (`make compare`) and
    docs/performance-quick.json (`nixlkv bench --quick --json`): regenerating either without the
    README fails here, so no figure of the front door is typed by hand and left behind."""
    text = (ROOT / "README.md").read_text()
    rows = json.loads((ROOT / "docs" / "comparison.json").read_text())["rows"]
    moved = [r for r in rows if r["expect"] == "ok"]
    refused = [r for r in rows if r["expect"] != "ok"]
    assert all(r["nixlkv"]["outcome"] == "byte-exact" for r in moved)
    assert all(r["nixlkv"]["outcome"] == "rejected" for r in refused)
    vllm = {k: sum(r["vllm"]["outcome"] == k for r in moved) for k in ("byte-exact", "wrong-bytes", "rejected", "not-run")}
    assert f"| {len(rows)} scenarios (" in text
    assert f"byte-exact on all {len(moved)} it should move; the {len(refused)} it must refuse, refused" in text
    assert (f"of those {len(moved)}: {vllm['byte-exact']} byte-exact, {vllm['wrong-bytes']} wrong bytes, "
            f"{vllm['rejected']} refused, {vllm['not-run']} not run") in text
    quick = json.loads((ROOT / "docs" / "performance-quick.json").read_text())
    assert f"{quick['plan_us_ours_p50']:.1f} µs p50 (**{quick['plan_time_ratio_vs_vllm']:.2f}×**)" in text
    assert f"{quick['plan_us_vllm_p50']:.1f} µs p50" in text
    assert f"**{quick['nixl_vs_ceiling_hetero']:.2f}** of the ceiling" in text


def test_performance_headline_is_the_committed_quick_run() -> None:
    """docs/performance.md's headline table states what docs/performance-quick.json holds (the saved
    `nixlkv bench --quick --json`): a new quick run without the table, or the reverse, fails here."""
    quick = json.loads((ROOT / "docs" / "performance-quick.json").read_text())
    rows = {m.group(1): line for line in (ROOT / "docs" / "performance.md").read_text().splitlines()
            if (m := re.match(r"^\| `([a-z0-9_]+)`", line))}
    shown = {
        "plan_time_ratio_vs_vllm": "{:.2f}", "plan_time_ratio_vs_vllm_fragmented": "{:.2f}",
        "plan_time_ratio_vs_vllm_equal_tp": "{:.2f}", "descs_ratio_vs_vllm_hetero": "{:.2f}",
        "descs_ratio_vs_vllm_hetero_staged": "{:.4f}", "registered_ratio_vs_vllm_4_engines_hetero": "{:.2f}",
        "handshake_ratio_vs_vllm_hetero": "{:.2f}", "handshake_other_blocks_ratio_vs_vllm_hetero": "{:.2f}",
        "handshake_first_ratio_vs_vllm_hetero": "{:.2f}", "handshake_ratio_vs_vllm_equal_tp": "{:.2f}",
        "nixl_vs_memcpy": "{:.2f}", "nixl_vs_memcpy_hetero": "{:.2f}", "nixl_vs_ceiling_hetero": "{:.2f}",
        "choose_us_hetero_p50": "{:.1f} µs",
    }
    wrong = {key: (fmt.format(quick[key]), rows.get(key)) for key, fmt in shown.items()
             if key not in rows or fmt.format(quick[key]) not in rows[key]}
    assert wrong == {}
    plan = rows["plan_time_ratio_vs_vllm"]
    assert f"{quick['plan_us_ours_p50']:.1f} µs / {quick['plan_us_vllm_p50']:.1f} µs p50" in plan


def test_readme_keeps_the_two_commands_ci_runs() -> None:
    """.ci/run runs `make test`, the README's test command; `make rehearse` is the main job."""
    text = (ROOT / "README.md").read_text()
    assert "make rehearse   # sets up .venv, then runs the main job" in text
    assert "make test       # sets up .venv and .serve-venv, then runs the whole test suite" in text
    assert "make test" in (ROOT / ".ci" / "run").read_text()
