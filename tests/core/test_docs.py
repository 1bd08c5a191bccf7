"""The documentation describes the present: the README is short and its commands run as
written, docs/settings.md is what its generator makes of the settings classes, every
relative link resolves, the layout page's example runs, the benchmark history reads, and
no code comment names an issue, a dated run or a path outside the repository."""

import ast
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 300

# README commands not run here, each with the reason (a prefix of the command as written)
SKIP = {
    "make demo": "installs the pinned environment, then starts real servers (minutes)",
    "make test": "installs both venvs and runs the whole suite",
    "kvbridge demo": "starts real engine servers (minutes)",
    "kvbridge route --config route.yaml": "serves, or probes, the deployment's servers; route.yaml is the reader's",
    "kvbridge bench all": "runs every benchmark (many minutes)",
    "export KVBRIDGE_SECRET=": "sets the deployment's secret for the servers below; nothing to run alone",
    "python -m sglang.launch_server": "starts an SGLang server",
    "python -m vllm.entrypoints.openai.api_server": "starts a vLLM server",
}
SHELL_BLOCKS = ("bash", "sh", "console", "shell")


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fenced_blocks(text: str, langs) -> list[str]:
    """The bodies of the fenced code blocks whose info string is one of ``langs``."""
    return [m.group(2) for m in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.M | re.S) if m.group(1) in langs]


def readme_commands() -> list[str]:
    """Every command of the README's shell blocks, continuation lines and quoted strings
    over several lines joined (``console`` blocks: the lines after a ``$ `` prompt)."""
    text = README.read_text(encoding="utf-8")
    cmds = []
    for m in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.M | re.S):
        if m.group(1) not in SHELL_BLOCKS:
            continue
        console = m.group(1) == "console"
        cur = ""
        for line in m.group(2).splitlines():
            if console and not cur:
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if not cur and (not line.strip() or line.lstrip().startswith("#")):
                continue
            cur += line
            if cur.endswith("\\"):
                cur = cur[:-1] + "\n"
                continue
            try:
                shlex.split(cur, comments=True)
            except ValueError:  # a quoted string goes on over the next line
                cur += "\n"
                continue
            cmds.append(cur.strip())
            cur = ""
    return cmds


def _skip_reason(cmd: str) -> str | None:
    return next((why for prefix, why in SKIP.items() if cmd.startswith(prefix)), None)


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n < MAX_README_LINES, f"README.md has {n} lines; keep it under {MAX_README_LINES} (move detail to docs/)"


def test_readme_skip_list_is_used():
    """Every entry of SKIP names a command the README has, and some commands do run."""
    cmds = readme_commands()
    unused = [p for p in SKIP if not any(c.startswith(p) for c in cmds)]
    assert not unused, f"SKIP entries no README command starts with (remove them): {unused}"
    assert sum(_skip_reason(c) is None for c in cmds) >= 3, cmds


RUN = [c for c in readme_commands() if _skip_reason(c) is None]


@pytest.fixture(scope="module")
def readme_runs() -> dict:
    """Every command of RUN, run as written (at once: each mostly waits on imports) with
    the venv's ``kvbridge`` on PATH."""
    from concurrent.futures import ThreadPoolExecutor

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}

    def run(cmd):
        return subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(RUN, pool.map(run, RUN)))


@pytest.mark.parametrize("cmd", RUN)
def test_readme_command_runs(cmd, readme_runs):
    """The README's cheap commands exit 0."""
    r = readme_runs[cmd]
    assert r.returncode == 0, f"`{cmd}` exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"


def test_readme_route_config_loads(tmp_path):
    """The README's route.yaml is one `kvbridge route --config` accepts."""
    from kvbridge.route import load_config

    blocks = [b for b in fenced_blocks(README.read_text(encoding="utf-8"), ("yaml",)) if b.startswith("model:")]
    assert blocks
    path = tmp_path / "route.yaml"
    path.write_text(blocks[0], encoding="utf-8")
    cfg = load_config(str(path))
    assert cfg.servers


def test_settings_doc_is_generated():
    gen = _load_script("settings_doc")
    want = gen.generate()
    have = (DOCS / "settings.md").read_text(encoding="utf-8") if (DOCS / "settings.md").exists() else ""
    assert have == want, (f"docs/settings.md is stale: regenerate it with `{gen.REGENERATE}` (or `make docs`) "
                          "and commit the result")
    assert gen.UNDOCUMENTED not in want, ("a settings field has no description: say what it is in its class "
                                          "docstring (or a comment on its line), then regenerate docs/settings.md")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return s.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M)}


def _md_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md")), *sorted((ROOT / "adapters").glob("*/README.md"))]


@pytest.mark.parametrize("path", _md_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    bad = []
    for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", text):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{path.relative_to(ROOT)}: broken links: {bad}"


def test_layout_example_runs(capsys):
    """docs/layout.md's python blocks run as written and print what the page says."""
    text = (DOCS / "layout.md").read_text(encoding="utf-8")
    blocks = fenced_blocks(text, ("python",))
    assert blocks
    for b in blocks:
        exec(compile(b, "docs/layout.md", "exec"), {"__name__": "docs_layout"})
    out = capsys.readouterr().out
    for said in re.findall(r"print\(.*\)\s+# (.+)", text):
        assert said.strip() in out, (said, out)


def test_bench_history_reads():
    bh = _load_script("bench_history")
    data = bh.load()
    assert data["runs"]
    rows = 0
    for run in data["runs"]:
        assert run["date"] and re.fullmatch(r"\d{4}-\d\d-\d\d", run["date"]), run["heading"]
        assert run["heading"] and run["blocks"], run
        for b in run["blocks"]:
            assert set(b) in ({"text"}, {"table"}), b.keys()
            if "table" in b:
                t = b["table"]
                assert t["rows"] and all(list(r["figures"]) == t["columns"][1:] for r in t["rows"]), t["columns"]
                rows += len(t["rows"])
    table = bh.rows_table(data["runs"]).splitlines()
    assert len(table) == rows + 2
    assert "## " + data["runs"][0]["heading"] in bh.render_full(data, data["runs"][:1])


# -- comments and docstrings describe the present ------------------------------------------------

_STALE = [
    (re.compile(r"\bissues?[ -]?#?\d+", re.I), "an issue number"),
    (re.compile(r"(?<![\w/&#-])#\d+\b"), "an issue number"),
    (re.compile(r"\b20\d\d-\d\d-\d\d\b"), "a dated run"),
    (re.compile(r"\.\./shared\b|/work/"), "a path outside the repository"),
]


def _py_comments(path: Path) -> list[tuple[int, str]]:
    src = path.read_text(encoding="utf-8")
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                out.append((body[0].lineno, body[0].value.value))
    return out


def _other_comments(path: Path) -> list[tuple[int, str]]:
    src = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix in (".c", ".h"):
        return [(src.count("\n", 0, m.start()) + 1, m.group(0)) for m in re.finditer(r"/\*.*?\*/|//[^\n]*", src, re.S)]
    return [(i, line[line.index("#"):]) for i, line in enumerate(src.splitlines(), 1) if "#" in line]


def _code_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    keep = []
    for rel in out:
        if rel.startswith((".venv", "build/")) or not (ROOT / rel).is_file():
            continue
        if rel.endswith((".py", ".c", ".h", ".sh")) or rel == "Makefile":
            keep.append(ROOT / rel)
    return keep


def test_comments_name_no_issue_run_or_outside_path():
    bad = []
    for path in _code_files():
        comments = _py_comments(path) if path.suffix == ".py" else _other_comments(path)
        for line, text in comments:
            for pat, what in _STALE:
                m = pat.search(text)
                if m:
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {what} ({m.group(0)!r})")
    assert not bad, "comments and docstrings describe the present behaviour, not its history:\n" + "\n".join(bad)


def test_skip_reasons_are_named():
    assert all(why.strip() for why in SKIP.values())
    for prefix in SKIP:
        assert shlex.split(prefix)  # a command prefix, not an empty pattern
