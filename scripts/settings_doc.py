"""Generate docs/settings.md from the settings classes themselves.

    python scripts/settings_doc.py                        # print the page
    python scripts/settings_doc.py --out docs/settings.md  # write it (what `make docs` runs)
    python scripts/settings_doc.py --check docs/settings.md  # exit 1 when the file is stale

Sources, nothing else: ``kvbridge.common.settings`` (``BridgeSettings``, ``read_settings``,
``DEPLOYMENT_WIDE``) and each plugin's config class (SGLang, TensorRT-LLM, vLLM): every
dataclass field's name, type and default; the class docstrings; the config modules'
docstrings, ``CONFIG_ENV`` constants and the ``prefix`` their ``load`` passes to
``read_settings``. A field's "what" is, in this order: a comment on the field's own line;
the clause of the class docstring that introduces it (````name```` after a ``:``, ``,``,
``;``, ``/`` or at a sentence start, up to the next such field or the sentence's end); the
comment on the field its default is taken from (e.g. ``HandoffConfig.deadline_s``); the
sentence that names it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import io
import json
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "settings.md"
REGENERATE = "python scripts/settings_doc.py --out docs/settings.md"

BASE = ("kvbridge.common.settings", "BridgeSettings")
PLUGINS = (  # (title, module, class)
    ("SGLang", "kvbridge.adapters.sglang.config", "SglangBridgeConfig"),
    ("TensorRT-LLM", "kvbridge.adapters.trtllm.config", "BridgeConfig"),
    ("vLLM", "kvbridge.adapters.vllm.config", "VllmBridgeConfig"),
)
UNDOCUMENTED = "(not described in the class docstring)"

_CODE = re.compile(r"``(.+?)``")


# -- reading the sources ---------------------------------------------------------------------

def _class_node(cls: type) -> tuple[ast.ClassDef, str]:
    src = Path(inspect.getsourcefile(cls)).read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node, src
    raise LookupError(f"class {cls.__name__} not found in its source")


def _line_comments(src: str) -> dict[int, str]:
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def field_sources(cls: type) -> dict[str, dict]:
    """Per field assigned in ``cls``'s own body: its trailing comment (if any) and, when its
    default is ``OtherClass.attr``, that class and attribute."""
    node, src = _class_node(cls)
    comments = _line_comments(src)
    out = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            info = {"comment": comments.get(stmt.lineno, "")}
            v = stmt.value
            if isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name):
                info["from"] = (v.value.id, v.attr)
            out[stmt.target.id] = info
    return out


def _referenced_comment(cls: type, ref: tuple[str, str]) -> str:
    """The trailing comment of field ``ref[1]`` of class ``ref[0]`` as ``cls``'s module sees it."""
    other = getattr(sys.modules[cls.__module__], ref[0], None)
    if not isinstance(other, type):
        return ""
    return field_sources(other).get(ref[1], {}).get("comment", "")


def env_prefix(cls: type) -> str:
    """The environment prefix ``cls``'s settings are read with: a ``prefix=`` its ``load``
    passes on, else the settings module's ``ENV_PREFIX`` (or ``read_settings``' default)."""
    settings = importlib.import_module(BASE[0])
    default = getattr(settings, "ENV_PREFIX", None)
    if default is None and hasattr(settings, "read_settings"):
        default = inspect.signature(settings.read_settings).parameters["prefix"].default
    load = cls.__dict__.get("load")
    if load is not None:
        fn = ast.parse(inspect.cleandoc("\n" + inspect.getsource(load.__func__)))
        for node in ast.walk(fn):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "prefix" and isinstance(kw.value, ast.Constant):
                        return kw.value.value
    return default or ""


def reader_doc(settings, base: type) -> tuple[str, str]:
    """(name, docstring) of the one reader of the settings."""
    load = base.__dict__.get("load")
    if load is not None and inspect.getdoc(load):
        return f"{base.__name__}.load", inspect.getdoc(load)
    fn = getattr(settings, "read_settings", None)
    return ("read_settings", inspect.getdoc(fn)) if fn is not None else ("", "")


# -- the docstring's clauses -----------------------------------------------------------------

def _paragraphs(doc: str) -> list[str]:
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", inspect.cleandoc(doc or "")) if p.strip()]


def _depths(text: str) -> list[int]:
    """Parenthesis depth at each character, code spans (````...````) not counted."""
    spans = [m.span() for m in _CODE.finditer(text)]
    depth, out, i, s = 0, [], 0, 0
    while i < len(text):
        if s < len(spans) and i == spans[s][0]:
            out.extend([depth] * (spans[s][1] - spans[s][0]))
            i = spans[s][1]
            s += 1
            continue
        c = text[i]
        if c == "(":
            out.append(depth)
            depth += 1
        elif c == ")":
            depth = max(depth - 1, 0)
            out.append(depth)
        else:
            out.append(depth)
        i += 1
    return out


def _sentence_ends(text: str, depth: list[int]) -> list[int]:
    ends = []
    for m in re.finditer(r"\.(?=\s+(?:[A-Z`\"]|$))|\.$", text):
        i = m.start()
        if depth[i] == 0 and not re.search(r"(?:e\.g|i\.e|etc)$", text[:i]):
            ends.append(i + 1)
    return ends + [len(text)]


def _mentions(text: str, names: set[str]) -> list[tuple[int, int, str, str]]:
    """(start, end, name, the separator before it) of every depth-0 ````name```` in ``text``."""
    depth = _depths(text)
    ends = _sentence_ends(text, depth)
    out = []
    for m in _CODE.finditer(text):
        if m.group(1) not in names or depth[m.start()] != 0:
            continue
        before = text[:m.start()].rstrip()
        sep = before[-1:] if before else "^"
        if any(e == len(before) for e in ends):
            sep = "^"
        elif re.search(r"\s(?:and|or)$", before):
            sep = "&"  # "``a`` (...) and ``b`` (...)": b is introduced too
        out.append((m.start(), m.end(), m.group(1), sep))
    return out


def _content_free(passage: str, name: str) -> bool:
    """Whether ``passage`` says nothing of ``name`` but its name (and a "(see ``X``)")."""
    rest = passage.replace(f"``{name}``", " ", 1)
    rest = re.sub(r"\(see ``[^`]*``\)", " ", rest)
    return not re.search(r"[A-Za-z0-9]", rest)


def docstring_clauses(doc: str, names: set[str]) -> dict[str, str]:
    """Each field's introducing clause in ``doc`` (see the module docstring)."""
    out: dict[str, str] = {}
    for para in _paragraphs(doc):
        depth = _depths(para)
        ends = _sentence_ends(para, depth)
        ms = _mentions(para, names)
        intros = [m for m in ms if m[3] in "^:;,(/&"]
        for k, (start, end, name, sep) in enumerate(intros):
            if name in out:
                continue
            if sep == "/" and k > 0 and intros[k - 1][1] <= start:
                start = intros[k - 1][0]  # "``a`` / ``b`` (...)": one clause for both
            stop = next(e for e in ends if e > end)
            for nxt in intros[k + 1:]:
                if nxt[0] < stop and nxt[3] != "/":
                    head = para[:nxt[0]].rstrip()
                    head = re.sub(r"\s(?:and|or)$", "", head) if nxt[3] == "&" else head
                    stop = len(head.rstrip(",;").rstrip())
                    break
            passage = para[start:stop].strip().rstrip(",;").strip()
            if passage.endswith(".") and not passage.endswith(".."):
                passage = passage[:-1]
            if not _content_free(passage, name):
                out[name] = passage
    return out


def docstring_sentence(doc: str, name: str) -> str:
    """The first sentence of ``doc`` that names ````name````; where that sentence is a list
    introduced by a label (``Label (...): ``a``, ``b``...``), the label alone."""
    for para in _paragraphs(doc):
        depth = _depths(para)
        start = 0
        for end in _sentence_ends(para, depth):
            sentence = para[start:end]
            at = sentence.find(f"``{name}``")
            if at >= 0:
                d = depth[start:end]
                colon = next((i for i in range(at) if sentence[i] == ":" and d[i] == 0), -1)
                spans_before = [m for m in _CODE.finditer(sentence[:max(colon, 0)]) if d[m.start()] == 0]
                if colon > 0 and not spans_before:
                    return sentence[:colon].strip()
                return sentence.strip().rstrip(".")
            start = end
    return ""


def what(cls: type, name: str, sources: dict, clauses: dict[str, str]) -> str:
    src = sources.get(name, {})
    if src.get("comment"):
        return src["comment"]
    if name in clauses:
        return clauses[name]
    if "from" in src:
        c = _referenced_comment(cls, src["from"])
        if c:
            return c
    return docstring_sentence(cls.__doc__ or "", name) or UNDOCUMENTED


# -- rendering -------------------------------------------------------------------------------

def md(text: str) -> str:
    """Docstring text as markdown: ````x```` -> `x`, table-safe."""
    return _CODE.sub(lambda m: f"`{m.group(1)}`", text).replace("|", "\\|")


def fmt_default(v) -> str:
    if v is dataclasses.MISSING:
        return "(required)"
    if isinstance(v, int) and not isinstance(v, bool) and v >= 1 << 20 and v % (1 << 20) == 0:
        return f"`{v}` ({v >> 20} MiB)"
    return f"`{json.dumps(v)}`"


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _type(f: dataclasses.Field) -> str:
    return md(f"``{f.type if isinstance(f.type, str) else getattr(f.type, '__name__', f.type)}``")


def _doc_prose(doc: str) -> str:
    return "\n\n".join(md(p) for p in _paragraphs(doc))


def _module_doc(mod) -> str:
    return _doc_prose(mod.__doc__ or "")


def generate() -> str:
    settings = importlib.import_module(BASE[0])
    base = getattr(settings, BASE[1])
    plugins = [(title, importlib.import_module(m), c) for title, m, c in PLUGINS]
    plugins = [(title, mod, getattr(mod, c)) for title, mod, c in plugins]
    wide = set(getattr(settings, "DEPLOYMENT_WIDE", ()))
    base_fields = _fields(base)
    reader, reader_text = reader_doc(settings, base)
    lines = [
        "# Settings",
        "",
        f"<!-- generated by `{REGENERATE}` (`make docs`) from the settings classes; "
        "edit their docstrings and fields, not this file -->",
        "",
        _module_doc(settings),
        "",
    ]
    if reader:
        lines += [f"The reader, `{reader}`: " + " ".join(md(reader_text).split()), ""]
    lines += ["| plugin | class | where its settings come from | settings file | environment |",
              "|---|---|---|---|---|"]
    for title, mod, cls in plugins:
        how = md(_paragraphs(mod.__doc__ or "")[0]) if mod.__doc__ else "-"
        cfg = getattr(mod, "CONFIG_ENV", None) or getattr(settings, "CONFIG_ENV", None)
        lines.append(f"| {title} | `{cls.__module__}.{cls.__name__}` | {how} | "
                     f"{f'`{cfg}` (JSON or YAML)' if cfg else '-'} | `{env_prefix(cls)}<NAME>` |")
    example = env_prefix(base) + "PEER_TIMEOUT_S"
    lines += [
        "",
        f"Names are the field names; in the environment, upper case after the prefix (e.g. `{example}`)."
        + (" Deployment-wide (every plugin also reads `KVBRIDGE_<NAME>`): "
           + ", ".join(f"`{n}`" for n in sorted(wide)) + "." if wide else ""),
        "",
        f"## Shared settings (`{base.__name__}`)",
        "",
        _doc_prose(base.__doc__ or ""),
        "",
        "| setting | type | default | what |",
        "|---|---|---|---|",
    ]
    sources = field_sources(base)
    clauses = docstring_clauses(base.__doc__ or "", set(base_fields))
    for name, f in base_fields.items():
        default = fmt_default(f.default if f.default is not dataclasses.MISSING else
                              (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default))
        overrides = []
        for title, _mod, cls in plugins:
            pf = _fields(cls)[name]
            if pf.default != f.default:
                overrides.append(f"{title}: {fmt_default(pf.default)}")
        if overrides:
            default += " (" + "; ".join(overrides) + ")"
        lines.append(f"| `{name}` | {_type(f)} | {default} | {md(what(base, name, sources, clauses))} |")
    for title, mod, cls in plugins:
        own = {n: f for n, f in _fields(cls).items() if n not in base_fields}
        lines += ["", f"## {title} (`{cls.__module__}.{cls.__name__}`)", "", _module_doc(mod), "",
                  _doc_prose(cls.__doc__ or "")]
        load = cls.__dict__.get("load")
        if load is not None and inspect.getdoc(load):
            lines += ["", f"`{cls.__name__}.load`: " + " ".join(md(inspect.getdoc(load)).split())]
        if own:
            sources = field_sources(cls)
            clauses = docstring_clauses(cls.__doc__ or "", set(_fields(cls)))
            lines += ["", "Its own settings, besides the shared ones:", "",
                      "| setting | type | default | what |", "|---|---|---|---|"]
            for name, f in own.items():
                lines.append(f"| `{name}` | {_type(f)} | {fmt_default(f.default)} | "
                             f"{md(what(cls, name, sources, clauses))} |")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--out", type=Path, help="write the page here")
    g.add_argument("--check", type=Path, help="exit 1 when this file differs from what would be generated")
    args = ap.parse_args(argv)
    text = generate()
    if args.check:
        if not args.check.exists() or args.check.read_text(encoding="utf-8") != text:
            print(f"{args.check} is stale: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
