"""References generated from the code, so they cannot drift: the configuration reference, the
credit-scheme table and one page per scheme, and the list of modules whose API is rendered.

Where each fact comes from:

- **a config field's description**: its YAML comment in ``configs/`` (the files where values are
  set). A group's default option (``configs/train.yaml``'s defaults list) speaks first, then the
  field's comment in the typed schema (it describes the default a field the option leaves unset
  takes), then the group's other options (their comments describe their own values);
  experiment and debug files hold deltas, so their comments come last.
- **a field's type, default and valid range**: the typed schema, :mod:`datc.config` (the code
  that enforces them): ``CHOICES``, ``POSITIVE``, ``NON_NEGATIVE`` and the ``must ...`` messages of
  ``validate``. The default is the composed ``configs/train.yaml``'s value after validation.
- **a credit scheme's facts**: the registry (:data:`datc.credit.CREDIT_SCHEMES`: inputs, output,
  normalization, row locality), its params dataclass (fields, types, defaults), its module
  docstring (the idea) and its ``configs/credit/`` file (field descriptions, the values a
  ``credit=<label>`` run gets), with the tests and results files that name it.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
TESTS = ROOT / "tests"
RESULTS = ROOT / "results"

# Modules whose API page is rendered from their docstrings: the pure math (no model, config or
# I/O inside, as tests/structure/test_import_graph.py keeps them) and the credit interface a scheme author
# writes against.
API_MODULES = [
    "datc.math.advantages",
    "datc.math.losses",
    "datc.math.logprobs",
    "datc.math.metrics",
    "datc.credit",
    "datc.credit.base",
    "datc.credit.weights",
    "datc.credit.datc_math",
    "datc.credit.diagnostics",
    "datc.registry",
]

_LINE = re.compile(r"^(?P<ind> *)(?P<key>[A-Za-z_]\w*):(?P<val>[^#]*)(?:#\s?(?P<com>.*))?$")


def yaml_comments(path: Path) -> tuple[bool, dict[str, str]]:
    """(is a ``# @package _global_`` file, dotted key -> its end-of-line comment) of one YAML
    file of ``configs/``. Nested maps give dotted keys (``train.steps``); list items are skipped."""
    lines = path.read_text().splitlines()
    is_global = any(ln.strip() == "# @package _global_" for ln in lines)
    stack: list[tuple[int, str]] = []
    out: dict[str, str] = {}
    for line in lines:
        m = _LINE.match(line)
        if not m:
            continue
        indent = len(m["ind"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = ".".join([k for _, k in stack] + [m["key"]])
        if m["com"] and m["com"].strip():
            out[key] = m["com"].strip()
        if not m["val"].strip():  # a map header: its children follow, indented
            stack.append((indent, m["key"]))
    return is_global, out


def header_comment(path: Path) -> str:
    """The comment lines that open a YAML file, joined (a config's one-paragraph summary)."""
    out = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text != "@package _global_":
            out.append(text)
    return " ".join(out)


@cache
def default_options() -> dict[str, str]:
    """Group -> the option ``configs/train.yaml`` picks for it (``policy`` -> ``tiny_gpt2``)."""
    import yaml

    defaults = yaml.safe_load((CONFIGS / "train.yaml").read_text())["defaults"]
    return {k: v for d in defaults if isinstance(d, dict) for k, v in d.items() if v is not None}


def config_groups_md() -> str:
    """The config groups, their options (the files of ``configs/<group>/``) and what each sets
    (the comment on its line of ``configs/train.yaml``'s defaults list)."""
    said = dict(re.findall(r"^\s*- (\w+): [^#\n]*#\s*(.*)$", (CONFIGS / "train.yaml").read_text(), flags=re.M))
    defaults = default_options()
    lines = ["| group | options | default | what it sets |", "|---|---|---|---|"]
    for group in sorted(p.name for p in CONFIGS.iterdir() if p.is_dir() and p.name != "hydra"):
        options = sorted(p.relative_to(CONFIGS / group).with_suffix("").as_posix() for p in (CONFIGS / group).rglob("*.yaml"))
        lines.append(f"| `{group}/` | {', '.join(f'`{o}`' for o in options)} | `{defaults.get(group, 'null')}` | "
                     f"{_cell(said.get(group, ''))} |")
    return "\n".join(lines)


def _schema_comments() -> list[tuple[str, str]]:
    """(dotted field, its ``# comment`` in the typed schema, :mod:`datc.config`) for every
    commented field: what a field means at its schema default, for a field the group's default
    option does not set."""
    from datc.config import TrainConfig

    out = []

    def walk(cls: type, prefix: str) -> None:
        comments = _dataclass_comments(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints.get(f.name, f.type)
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
            elif comments.get(f.name):
                out.append((f"{prefix}{f.name}", comments[f.name]))

    walk(TrainConfig, "")
    return out


def _comment_sources() -> list[tuple[int, str, str, str]]:
    """(rank, file, dotted field, comment) for every commented key of ``configs/`` and of the
    schema; a lower rank speaks first: the group's default option 0, the schema 1 (it describes
    the default a field takes where that option does not set it), the group's other options 2
    (they describe their own values: ``init: policy``), deltas 3."""
    out = [(1, "datc/config.py", key, comment) for key, comment in _schema_comments()]
    defaults = default_options()
    for path in sorted(CONFIGS.rglob("*.yaml")):
        rel = path.relative_to(CONFIGS)
        if rel.parts[0] == "hydra":
            continue
        is_global, comments = yaml_comments(path)
        group = "" if len(rel.parts) == 1 or is_global else rel.parts[0]
        if rel.parts[0] in ("experiment", "debug"):
            rank = 3
        elif not group or defaults.get(group) == rel.stem:
            rank = 0
        else:
            rank = 2
        for key, comment in comments.items():
            out.append((rank, str(rel), f"{group}.{key}" if group else key, comment))
    return sorted(out)


def _is_note(comment: str) -> bool:
    """An option's note that a field does not apply to it, not a description of the field."""
    return comment.lower().startswith(("unused", "not used"))


@cache
def field_descriptions() -> dict[str, tuple[str, str]]:
    """Dotted config field -> (description, the file it comes from)."""
    out: dict[str, tuple[str, str]] = {}
    for _, rel, key, comment in _comment_sources():
        if key not in out and not _is_note(comment):
            out[key] = (comment, rel)
    return out


@dataclass
class ConfigField:
    name: str  # dotted, e.g. trainer.lr
    type: str
    default: Any  # the composed configs/train.yaml's value, validated
    valid: str  # the schema's range or choices, "" where only the type is checked
    description: str  # "" where no YAML comment describes it
    source: str  # the configs/ file the description comes from


def _type_name(tp: Any) -> str:
    if isinstance(tp, str):
        return tp
    return re.sub(r"typing\.|<class '([^']+)'>", lambda m: m.group(1) or "", str(tp)).replace("NoneType", "None")


def _leaves(obj: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted name, type, value) of every leaf field of a schema instance; a free-form dict
    (``policy.arch``) is one leaf."""
    out = []
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out += _leaves(value, name + ".")
        else:
            out.append((name, hints.get(f.name, f.type), value))
    return out


# The modules whose ConfigError messages say what a field must be: the schema's own checks and
# every room's check that datc.checks.validate calls.
CHECK_MODULES = ("datc/config.py", "datc/backends/checks.py", "datc/engines/checks.py", "datc/data/checks.py",
                 "datc/models/lora.py", "datc/credit/__init__.py", "datc/rewards/rules.py")


def _must_messages() -> dict[str, list[str]]:
    """Field -> the ``must ...`` phrases of the ``ConfigError`` messages of :data:`CHECK_MODULES`."""
    root = Path(__file__).resolve().parents[2]
    src = "\n".join((root / m).read_text() for m in CHECK_MODULES)
    out: dict[str, list[str]] = {}
    for field, phrase in re.findall(r'f?"([a-z_]+(?:\.[a-z_]+)+): (must [^"{]*?)(?:, got|"|\{)', src):
        phrase = phrase.strip().rstrip(",;")
        if phrase not in out.setdefault(field, []):
            out[field].append(phrase)
    return out


def _valid(name: str) -> str:
    from datc import config

    parts = []
    if name in config.CHOICES:
        parts.append(" | ".join("null" if c is None else f"`{c}`" for c in config.CHOICES[name]))
    if name in config.POSITIVE:
        parts.append("> 0")
    if name in config.NON_NEGATIVE:
        parts.append(">= 0")
    parts += [p.removeprefix("must ").removeprefix("be ") for p in _must_messages().get(name, [])]
    return "; ".join(parts)


@cache
def default_config():
    """The validated ``configs/train.yaml`` with no overrides (what ``datc-train`` runs)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from datc.checks import validate
    from datc.paths import CONFIG_DIR

    if GlobalHydra.instance().is_initialized():
        return validate(compose(config_name="train"))
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return validate(compose(config_name="train"))


def config_fields() -> list[ConfigField]:
    """Every field of the typed schema except the credit group's (documented per scheme)."""
    descriptions = field_descriptions()
    out = []
    for name, tp, value in _leaves(default_config()):
        if name == "credit":
            continue
        text, source = descriptions.get(name, ("", ""))
        out.append(ConfigField(name, _type_name(tp), value, _valid(name), text, source))
    return out


def _value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, str) and v.startswith(str(Path.home()) + "/"):  # cache_dir: not the builder's home
        return "~" + v[len(str(Path.home())):]
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (dict, list)) and len(str(v)) > 40:
        return "(see the file)"
    return str(v)


def _cell(text: str) -> str:
    """``text`` as one Markdown table cell: a ``|`` outside a code span escaped (``\\|``), one
    inside a code span left alone (Python-Markdown's tables keep a code span whole, and would show
    the backslash there), line breaks as spaces; and :func:`_text`'s ``<`` escape."""
    parts = _text(text.replace("\n", " ")).split("`")
    return "`".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts))


def _text(text: str) -> str:
    """``text`` with each ``<`` outside a code span written ``&lt;``: a comment's placeholder
    (``experiment/<name>.yaml``, ``<think>``) would otherwise be read as an HTML tag and vanish."""
    parts = text.split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def _code(text: str) -> str:
    """``text`` as a code span in a table cell."""
    return _cell(f"`{text}`")


def config_reference_md() -> str:
    """The configuration reference page, one table per group."""
    groups: dict[str, list[ConfigField]] = {}
    for f in config_fields():
        groups.setdefault(f.name.split(".")[0] if "." in f.name else "run", []).append(f)
    defaults = default_options()
    lines = [
        "# Configuration reference",
        "",
        "Generated at build time from the typed schema (`datc/config.py`: fields, types, valid",
        "ranges) and the YAML comments of `configs/` (descriptions; the schema's own comment for a field",
        "the group's default option does not set); see",
        "[Configuration](../configuration.md) for how the two divide the work. *Default* is the",
        "value `datc-train` runs with no overrides (`configs/train.yaml` composed and validated).",
        "The credit group's fields are each scheme's: see [Credit schemes](../schemes/index.md).",
        "",
    ]
    for group, fields in groups.items():
        title = "Run-level fields (`configs/train.yaml`)" if group == "run" else f"`{group}` (default option: `{defaults.get(group, '-')}`)"
        lines += [f"## {title}", "", "| field | type | default | valid | description |", "|---|---|---|---|---|"]
        for f in fields:
            src = f" <small>({f.source})</small>" if f.source else ""
            field = f.name.replace(".", ".<wbr>")  # a long name breaks after a dot, never mid-word (docs/stylesheets)
            lines.append(f"| <code class=\"field\">{field}</code> | {_code(f.type)} | {_code(_value(f.default))} | {_cell(f.valid)} | "
                         f"{_cell(f.description)}{src} |")
        lines.append("")
    return "\n".join(lines)


# ---- credit schemes ---------------------------------------------------------------------------


@dataclass
class SchemeField:
    name: str
    type: str
    value: Any  # what credit=<label> sets (its config file, else the dataclass default)
    description: str


@dataclass
class SchemeInfo:
    label: str  # credit=<label>, the run's name
    key: str | None  # the registered scheme that computes it (None: a _target_ config)
    scheme: Any  # datc.credit.base.CreditScheme
    config_file: str | None  # configs/credit/<label>.yaml, None for a scheme without one
    summary: str  # one line: the config file's header comment, else the scheme's docstring
    idea: str  # the scheme module's docstring
    fields: list[SchemeField]


def _rst_to_md(text: str) -> str:
    text = re.sub(r":(?:func|class|mod|data|meth|attr):`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _dataclass_comments(cls: type) -> dict[str, str]:
    """Field -> its end-of-line ``# comment`` in the dataclass source, inherited ones included."""
    import inspect
    import io
    import tokenize

    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            src = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        last_name = None
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type == tokenize.NAME and tok.start[1] == 4 and last_name is None:
                last_name = tok.string
            elif tok.type == tokenize.COMMENT and last_name:
                out[last_name] = tok.string.lstrip("#").strip()
            elif tok.type in (tokenize.NEWLINE, tokenize.NL):
                last_name = None
    return out


def _credit_yaml_comments(label: str) -> dict[str, str]:
    """Field -> comment over the files ``credit=<label>`` composes (its defaults first)."""
    import yaml

    path = CONFIGS / "credit" / f"{label}.yaml"
    if not path.exists():
        return {}
    out: dict[str, str] = {}
    for d in (yaml.safe_load(path.read_text()) or {}).get("defaults", []):
        if isinstance(d, str) and d != "_self_":
            out.update(_credit_yaml_comments(d))
    out.update({k: c for k, c in yaml_comments(path)[1].items() if not k.startswith("defaults")})
    return out


def scheme_infos() -> list[SchemeInfo]:
    """Every credit label a run can carry (:func:`datc.credit.configs.credit_labels`)."""
    import sys

    from datc.credit import resolve_scheme, scheme_key
    from datc.credit.configs import credit_configs

    out = []
    for label, node in credit_configs().items():
        scheme, params = resolve_scheme(node)
        key = scheme_key(node)
        path = CONFIGS / "credit" / f"{label}.yaml"
        comments = {**_dataclass_comments(scheme.params), **_credit_yaml_comments(label)}
        hints = typing.get_type_hints(scheme.params)
        fields = [SchemeField(f.name, _type_name(hints.get(f.name, f.type)), getattr(params, f.name), comments.get(f.name, ""))
                  for f in dataclasses.fields(params)]
        module = sys.modules.get(scheme.fn.__module__)
        idea = _rst_to_md((module.__doc__ or "").strip()) if module is not None else ""
        summary = header_comment(path) if path.exists() else ""
        out.append(SchemeInfo(label, key, scheme, f"configs/credit/{label}.yaml" if path.exists() else None,
                              _rst_to_md(summary or scheme.doc.splitlines()[0] if scheme.doc else summary), idea, fields))
    return out


def _needs(scheme) -> str:
    return ", ".join(f"`{n}`" for n in sorted(scheme.needs)) or "none"


def _normalization(scheme) -> str:
    if scheme.output == "scores":
        return "per response, mean 1 (the shared weight step)"
    return {"per_response": "per response", "global": "global (over the batch, every rank)",
            "none": "none (weights taken as they are)"}[scheme.normalization]


def schemes_table_md() -> str:
    """One line per credit label: what it is, its inputs, its normalization."""
    lines = ["| `credit=` | scheme | what it does | inputs it declares | normalization |", "|---|---|---|---|---|"]
    for s in scheme_infos():
        lines.append(f"| [`{s.label}`]({s.label}.md) | `{s.key or s.scheme.name}` | {_cell(s.summary)} | "
                     f"{_needs(s.scheme)} | {_normalization(s.scheme)} |")
    return "\n".join(lines)


@cache
def _test_functions() -> list[tuple[str, str, str]]:
    """(test file relative to the root, test name, its source) for every test function."""
    out = []
    for path in sorted(TESTS.rglob("test_*.py")):
        src = path.read_text()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                out.append((str(path.relative_to(ROOT)), node.name, ast.get_source_segment(src, node) or ""))
    return out


def scheme_tests(label: str) -> tuple[list[str], list[str]]:
    """Tests that pin a scheme: (those of its own file ``tests/credit/test_<label>.py``, the
    others whose body names the label as a string or a ``credit=`` override)."""
    own_file = f"tests/credit/test_{label}.py"
    pattern = re.compile(r"""(["']|credit=)""" + re.escape(label) + r"""["'\s,)\]]""")
    own, other = [], []
    for file, name, src in _test_functions():
        if file == own_file:
            own.append(f"{file}::{name}")
        elif pattern.search(src):
            other.append(f"{file}::{name}")
    return own, other


def scheme_results(label: str) -> list[str]:
    """Results files (Markdown, relative to ``results/``) whose text names the label in backticks
    or as a table cell."""
    pattern = re.compile(rf"(`{re.escape(label)}`|\|\s*{re.escape(label)}\s*\|)")
    return [str(p.relative_to(RESULTS)) for p in sorted(RESULTS.rglob("*.md")) if pattern.search(p.read_text())]


def scheme_page_md(s: SchemeInfo) -> str:
    """One scheme's page on the fixed skeleton: idea, fields, needs and normalization, tests,
    results."""
    sch = s.scheme
    lines = [f"# `{s.label}`", "", _text(s.summary), "", "```bash", f"datc-train credit={s.label}", "```", "", "## Idea", ""]
    if s.key and s.key != s.label:
        lines += [f"A configuration of the registered scheme [`{s.key}`]({s.key}.md) (`scheme: {s.key}` in "
                  f"`{s.config_file}`); it differs from it in the fields below whose value differs.", ""]
    lines += [s.idea or "(no module docstring)", "", "## Fields", ""]
    if s.fields:
        lines += ["| field | type | value | description |", "|---|---|---|---|"]
        lines += [f"| `{f.name}` | {_code(f.type)} | {_code(_value(f.value))} | {_cell(f.description)} |" for f in s.fields]
        lines += ["", f"Override any of them on the command line: `credit={s.label} credit.{s.fields[0].name}=...`."]
    else:
        lines.append("None.")
    lines += [
        "", "## Needs and normalization", "",
        f"- **inputs it declares**: {_needs(sch)} (the step computes exactly these; see [Writing a scheme](../writing-a-scheme.md))",
        f"- **output**: `{sch.output}`" + (" (turned into weights by the shared weight step, `datc/credit/weights.py`)"
                                             if sch.output == "scores" else ""),
        f"- **normalization**: {_normalization(sch)}",
        f"- **row-local**: {'yes: credit is computed one micro-batch of rows at a time' if sch.row_local else 'no: it sees the whole batch'}",
        f"- **row-separable**: {'yes: the zero-advantage skip computes it only for responses with A ≠ 0' if sch.row_separable else 'no: computed for every response (the zero-advantage skip does not apply)'}",
        f"- **code**: `{sch.fn.__module__}`" + (f", config `{s.config_file}`" if s.config_file else ""),
        "", "## Tests that pin it", "",
    ]
    own, other = scheme_tests(s.label)
    if own:
        lines += [f"Its own tests, `tests/credit/test_{s.label}.py`:", ""] + [f"- `{t.split('::')[1]}`" for t in own] + [""]
    if other:
        lines += [f'??? note "{len(other)} other tests name `{s.label}`"', ""] + [f"    - `{t}`" for t in other] + [""]
    if not own and not other:
        lines.append("None name it directly.")
    lines += ["", "## Results", ""]
    results = scheme_results(s.label)
    lines += [f"- [`results/{r}`](../results/{r})" for r in results] or ["No committed results name it yet."]
    return "\n".join(lines) + "\n"


# ---- the README's scheme table ------------------------------------------------------------------

README_TABLE_START = "<!-- schemes: generated from the registry by `python -m scripts.docs.reference --readme` -->"
README_TABLE_END = "<!-- /schemes -->"


def _first_sentence(text: str) -> str:
    """``text`` up to its first sentence's full stop (a stop followed by a space and a capital)."""
    m = re.search(r"(?<=\S)\.\s+(?=[A-Z])", text)
    return text[: m.start() + 1] if m else text


def readme_schemes_table_md() -> str:
    """The README's table: every credit label a run can carry, the baseline first, with the first
    sentence of its config's header comment (the same source as its docs page)."""
    infos = sorted(scheme_infos(), key=lambda s: (s.label != "grpo", s.label))
    lines = ["| `credit=` | what it does |", "|---|---|"]
    lines += [f"| `{s.label}` | {_cell(_first_sentence(s.summary))} |" for s in infos]
    return "\n".join(lines)


def readme_with_schemes_table(readme: str) -> str:
    """``readme`` with the text between its scheme-table markers replaced by the generated table."""
    a, b = readme.index(README_TABLE_START) + len(README_TABLE_START), readme.index(README_TABLE_END)
    return readme[:a] + "\n" + readme_schemes_table_md() + "\n" + readme[b:]


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m scripts.docs.reference",
                                     description="Rewrite the README's scheme table from the registry.")
    parser.add_argument("--readme", action="store_true", help="rewrite README.md's table between its markers")
    args = parser.parse_args(argv)
    if not args.readme:
        parser.print_help()
        return 2
    path = Path(__file__).resolve().parents[2] / "README.md"
    text = path.read_text()
    new = readme_with_schemes_table(text)
    if new != text:
        path.write_text(new)
    print(f"README.md: {'rewritten' if new != text else 'already up to date'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
