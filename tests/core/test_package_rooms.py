"""The rooms of the package and which may import which.

- The core (``layout/``, ``common/``) imports no adapter, router, demo, benchmark or CLI;
  ``common`` points to ``layout`` only, and ``layout`` is pure.
- An adapter imports no other adapter, and no router, demo, benchmark or CLI.
- The router (``route/``) imports no demo and no benchmark: the demo composes the router.
- The core a serving process loads (``layout/``, ``common/``, ``adapters/``) holds no
  benchmark, report or plot code.

Read from the source of every module (every import statement, wherever it sits, lazily or
not; relative imports resolved; ``importlib.import_module`` / ``__import__`` of a literal
name counted) and checked once by importing the core in a fresh interpreter."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
CORE = ("layout", "common", "adapters")
ADAPTERS = ("sglang", "trtllm", "vllm")
ENGINES = {"sglang", "tensorrt_llm", "vllm", "mooncake", "transformers"}
NETWORK = {"socket", "ssl", "http", "urllib", "asyncio", "selectors", "socketserver", "zmq", "aiohttp", "requests",
           "multiprocessing", "subprocess"}
BENCH_ONLY = {"matplotlib", "pytest", "hypothesis", "rich", "openai", "subprocess"}
# data trees shipped beside the demo's modules, put on another process's PYTHONPATH: not kvbridge modules
NOT_MODULES = ("demo/trtllm/site", "demo/sgl_shim")

# room (a package, and everything under it) -> the packages it must not import
OUTSIDE_CORE = ("kvbridge.bench", "kvbridge.demo", "kvbridge.route", "kvbridge.cli")
FORBIDDEN = {
    "kvbridge.layout": ("kvbridge.common", "kvbridge.adapters", *OUTSIDE_CORE),
    "kvbridge.common": ("kvbridge.adapters", *OUTSIDE_CORE),
    **{f"kvbridge.adapters.{a}": (*(f"kvbridge.adapters.{b}" for b in ADAPTERS if b != a), *OUTSIDE_CORE)
       for a in ADAPTERS},
    "kvbridge.route": ("kvbridge.demo", "kvbridge.bench"),
}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _package_dirs() -> dict[str, Path]:
    """Import package -> its folder, from ``[tool.setuptools.package-dir]``."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {pkg: ROOT / d for pkg, d in dirs.items()}


def _all_modules() -> dict[Path, str]:
    """Every .py file of the package rooms -> its dotted module name."""
    out: dict[Path, str] = {}
    for pkg, folder in sorted(_package_dirs().items(), key=lambda kv: len(kv[0])):  # deepest mapping wins
        for f in folder.rglob("*.py"):
            rel = f.relative_to(ROOT).as_posix()
            if any(rel.startswith(d + "/") for d in NOT_MODULES):
                continue
            parts = f.relative_to(folder).with_suffix("").parts
            out[f] = ".".join((pkg, *parts[:-1]) + (() if parts[-1] == "__init__" else (parts[-1],)))
    return out


def _imports(source: str, module: str, is_package: bool = False, filename: str = "<src>") -> list[tuple[str, int]]:
    """Every import of a module as (absolute dotted name, line); ``from X import a`` gives
    ``X.a`` (``a`` may be a submodule), relative names resolved against ``module``."""
    package = module if is_package else module.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for n in ast.walk(ast.parse(source, filename)):
        if isinstance(n, ast.Import):
            out += [(a.name, n.lineno) for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                parts = package.split(".")
                if n.level - 1 >= len(parts):
                    out.append(("." * n.level + base, n.lineno))  # leaves the top package
                    continue
                base = ".".join(parts[:len(parts) - (n.level - 1)] + ([base] if base else []))
            out += [(base if a.name == "*" else f"{base}.{a.name}", n.lineno) for a in n.names]
        elif (isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Constant)
              and isinstance(n.args[0].value, str)
              and ((isinstance(n.func, ast.Name) and n.func.id in ("__import__", "import_module"))
                   or (isinstance(n.func, ast.Attribute) and n.func.attr == "import_module"))):
            out.append((n.args[0].value, n.lineno))
    return out


def _module_imports(f: Path, module: str) -> list[tuple[str, int]]:
    return _imports(f.read_text(), module, f.name == "__init__.py", str(f))


def _modules(room: str) -> list[tuple[Path, str]]:
    files = [(f, m) for f, m in sorted(_all_modules().items()) if _under(m, "kvbridge." + room.replace("/", "."))]
    assert files, room
    return files


def test_import_names_are_resolved():
    src = ("from .. import demo\nfrom ..bench.route import x\nfrom . import pool\nimport kvbridge.demo.run\n"
           "from kvbridge.adapters import trtllm as t\nimportlib.import_module('kvbridge.bench')\n")
    assert [n for n, _ in _imports(src, "kvbridge.route.app")] == [
        "kvbridge.demo", "kvbridge.bench.route.x", "kvbridge.route.pool", "kvbridge.demo.run",
        "kvbridge.adapters.trtllm", "kvbridge.bench"]
    assert [n for n, _ in _imports("from ..vllm.handle import H\n", "kvbridge.adapters.sglang", True)] == [
        "kvbridge.adapters.vllm.handle.H"]
    assert _imports("from .... import x\n", "kvbridge.layout.plan") == [("....", 1)]


def test_every_module_of_the_rooms_is_read():
    mods = set(_all_modules().values())
    for want in ("kvbridge.cli", "kvbridge.layout", "kvbridge.common.settings", "kvbridge.route.app",
                 "kvbridge.demo.route_local", "kvbridge.demo.trtllm.server", "kvbridge.bench.route",
                 *(f"kvbridge.adapters.{a}" for a in ADAPTERS)):
        assert want in mods, want
    assert not [m for m in mods if "tensorrt_llm" in m or "sgl_kernel" in m]


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_room_imports_only_what_it_may(room):
    bad = []
    for f, module in sorted(_all_modules().items()):
        if not _under(module, room):
            continue
        for name, line in _module_imports(f, module):
            hit = [p for p in FORBIDDEN[room] if _under(name, p)]
            if hit or name.startswith("."):
                bad.append(f"{f.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, f"{room} may not import {', '.join(FORBIDDEN[room])}:\n" + "\n".join(bad)


@pytest.mark.parametrize("room", ["layout", "common", *(f"adapters/{a}" for a in ADAPTERS)])
def test_no_import_cycle_inside_a_room(room):
    """Inside the core and each adapter, the modules import one another without a cycle
    (lazy imports inside functions counted): each can be read, and changed, from the
    modules it names down, never back up. A package's own ``__init__`` is left out (it
    re-exports its modules)."""
    mods = {m: f for f, m in _modules(room) if f.name != "__init__.py"}
    edges = {m: sorted({n for n, _ in _module_imports(f, m)
                        for t in mods if t != m and (n == t or n.startswith(t + "."))
                        for n in [t]}) for m, f in mods.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in edges[m]:
            if state.get(n) == 1:
                cycle = path[path.index(n):] + [n]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(mods):
        if m not in state:
            visit(m, [m])


@pytest.mark.parametrize("room", CORE)
def test_core_holds_no_bench_report_or_plot_module(room):
    for f, module in _modules(room):
        rel = f.relative_to(ROOT)
        assert not any(w in f.stem for w in ("bench", "report", "plot")), f"{rel}: belongs in bench/ (kvbridge.bench)"
        for name, line in _module_imports(f, module):
            top = name.split(".")[0]
            assert not any(_under(name, p) for p in OUTSIDE_CORE), \
                f"{rel}:{line} imports {name}: the core imports only kvbridge.layout, .common and .adapters"
            assert top not in BENCH_ONLY, f"{rel}:{line} imports {name}: benchmark/report/tool code belongs in bench/"


def test_layout_core_imports_no_engine_network_or_other_room():
    for f, module in _modules("layout"):
        rel = f.relative_to(ROOT)
        for name, line in _module_imports(f, module):
            top = name.split(".")[0]
            if top == "kvbridge":
                assert _under(name, "kvbridge.layout"), f"{rel}:{line}: layout imports {name}"
                continue
            assert top not in ENGINES | NETWORK, f"{rel}:{line}: the layout core imports {name} (engine or network)"
            assert top in sys.stdlib_module_names or top in ("torch", "numpy", "xxhash"), \
                f"{rel}:{line}: the layout core imports {name} (only the standard library, torch, numpy and xxhash)"


def test_dependencies_point_adapters_to_common_to_layout():
    for f, module in _modules("common"):
        for name, line in _module_imports(f, module):
            assert not _under(name, "kvbridge.adapters"), f"{f.relative_to(ROOT)}:{line} imports {name}"
            if name.startswith("kvbridge."):
                assert _under(name, "kvbridge.common") or _under(name, "kvbridge.layout"), \
                    f"{f.relative_to(ROOT)}:{line} imports {name}"


_PROBE = r"""
import importlib, json, pkgutil, sys
import kvbridge.layout
layout_loaded = sorted(sys.modules)
import kvbridge.common, kvbridge.adapters.sglang
for m in pkgutil.iter_modules(kvbridge.common.__path__):
    importlib.import_module("kvbridge.common." + m.name)
print(json.dumps({"layout": layout_loaded, "core": sorted(sys.modules)}))
"""


def test_importing_the_core_loads_no_engine_network_or_bench_module():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    tops = {m.split(".")[0] for m in got["layout"]}
    assert not tops & (ENGINES | {"zmq", "aiohttp", "msgspec"}), sorted(tops & (ENGINES | {"zmq", "aiohttp"}))
    assert "kvbridge.common" not in got["layout"]
    core = set(got["core"])
    assert "kvbridge.common.transport" in core  # the walk imported the core's modules
    assert not {m for m in core if m.startswith(("kvbridge.bench", "kvbridge.demo", "kvbridge.route"))
                or m.split(".")[0] in ("matplotlib", "pytest")}


def test_cli_docstring_names_every_command():
    import argparse

    import kvbridge.cli as cli

    def subcommands(parser) -> dict:
        acts = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return dict(acts[0].choices) if acts else {}

    top = subcommands(cli.build_parser())
    assert {"demo", "bench", "report", "plan", "announce", "route"} <= set(top)
    for name, p in top.items():
        assert f"``kvbridge {name}" in cli.__doc__, name
    import re

    named = {s for m in re.findall(r"``kvbridge bench ([a-z|]+)``", cli.__doc__) for s in m.split("|")}
    assert set(subcommands(top["bench"])) == named
