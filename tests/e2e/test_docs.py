"""The documentation cannot drift from the code: the site builds with ``--strict``, every logged
metric has an entry in the metrics page, every config field a description, every command shown
in the README and the getting-started page is run by a test or marked illustrative, and every
figure the README states links to the results file that holds it."""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.docs import reference

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
METRIC = r"(?:reward|rollout|credit|loss|eval|perf)/[a-z0-9_<>]+"

# ---- the site ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_site_builds_strict_with_every_page(tmp_path):
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    # Pages are files (use_directory_urls: false), so site/index.html is browsable from the disk
    pages = {p.relative_to(site).with_suffix("").as_posix() for p in site.rglob("*.html")}
    for page in ("index", "getting-started", "METHOD", "architecture", "configuration", "reference/config", "metrics",
                 "schemes/index", "writing-a-scheme", "real-models", "scaling-out", "performance", "gpu-check",
                 "reliability", "testing", "results/index", "api/index"):
        assert page in pages, page
    for info in reference.scheme_infos():
        assert f"schemes/{info.label}" in pages
    for module in reference.API_MODULES:  # mkdocstrings rendered something from the docstrings
        html = (site / "api" / f"{module}.html").read_text()
        assert 'class="doc doc-' in html, module
    assert (site / "results" / "four_settings" / "gold_curves.png").exists()  # results files are served
    # Opened as a file, every page's links lead to files: a link to a folder opened a file listing
    for page in [site / "index.html", site / "getting-started.html", site / "schemes" / "index.html"]:
        links = re.findall(r'href="([^"#?]+)', page.read_text())
        local = [ln for ln in links if not re.match(r"[a-z]+:", ln)]
        assert len(local) > 20, page
        for link in local:
            target = (page.parent / link).resolve()
            assert target.is_file(), f"{page.relative_to(site)} links to {link}, not a file"
    # Pages left out of the nav by design (scheme, API and results pages) are not listed at every build
    assert "not included in the" not in r.stderr, r.stderr[:3000]


def test_strict_mode_and_no_fetching_plugins_are_configured():
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)  # !!python/name tags
    cfg = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)
    assert cfg["strict"] is True and cfg["theme"]["font"] is False
    names = [p if isinstance(p, str) else next(iter(p)) for p in cfg["plugins"]]
    assert not {"social", "privacy", "meta"} & set(names)
    assert "make docs" in (ROOT / "Makefile").read_text() or "docs:" in (ROOT / "Makefile").read_text()


# ---- metrics ----------------------------------------------------------------------------------


def documented_metrics() -> list[str]:
    """The keys of the metrics page: the first cell of each table row."""
    return re.findall(rf"^\| `({METRIC})` \|", (DOCS / "metrics.md").read_text(), flags=re.M)


def _matches(key: str, documented: list[str]) -> bool:
    if "<" in key:  # a template from an f-string: the page must show the same template
        return any(re.sub(r"<[^>]*>", "<>", d) == key for d in documented)
    return any(re.fullmatch(re.sub(r"<[a-z_]+>", "[a-z0-9_]+", re.escape(d).replace(r"\<", "<").replace(r"\>", ">")), key)
               for d in documented)


def literal_metric_keys() -> set[str]:
    """Every metric key written as a string literal in the package (``"credit/ess"``), and the
    ``credit/`` keys the diagnostics build from their key lists."""
    keys = set()
    for path in (ROOT / "datc").rglob("*.py"):
        tree = ast.parse(path.read_text())
        parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in parts \
                    and re.fullmatch(METRIC, node.value):
                keys.add(node.value)
            elif isinstance(node, ast.JoinedStr):  # f"reward/rule_{name}" -> "reward/rule_<>"
                key = "".join(v.value if isinstance(v, ast.Constant) else "<>" for v in node.values)
                if re.fullmatch(METRIC, key) and not re.fullmatch(r"[a-z]+/<>", key):  # f"loss/{k}": the run test's
                    keys.add(key)
    from datc.credit.diagnostics import SCORE_KEYS, WEIGHT_KEYS

    return keys | {f"credit/{k}" for k in WEIGHT_KEYS + SCORE_KEYS}


def test_every_literal_metric_key_has_an_entry():
    documented = documented_metrics()
    assert len(documented) == len(set(documented)), "a key is documented twice"
    missing = sorted(k for k in literal_metric_keys() if not _matches(k, documented))
    assert not missing, f"logged but not in docs/metrics.md: {missing}"


def test_the_metric_pattern_matcher():
    assert _matches("reward/rule_length", ["reward/rule_<name>"]) and _matches("reward/rule_<>", ["reward/rule_<name>"])
    assert not _matches("reward/rules", ["reward/rule_<name>"]) and not _matches("loss/kl2", ["loss/kl"])


@pytest.fixture(scope="module")
def step_and_eval_keys(cache_dir, tmp_path_factory):
    """The keys one real training step and one evaluation log (credit=datc, a reward rule, on the
    testbed with debug=fast): what a run actually writes, f-string keys included."""
    from datc.training.trainer import train
    from tests.helpers.testbed import cfg_for

    d = tmp_path_factory.mktemp("metrics_run")
    cfg = cfg_for(cache_dir, d / "run", "credit=datc", "trainer.steps=1", "reward.rules=[{name: length, weight: 0.0}]")
    train(cfg)
    rows = [json.loads(x) for x in (d / "run" / "metrics.jsonl").read_text().splitlines()]
    return {k for r in rows for k in r if k != "step"}


@pytest.mark.slow
def test_every_key_a_run_logs_has_an_entry_and_every_entry_is_logged(step_and_eval_keys):
    documented = documented_metrics()
    assert {"loss/kl", "credit/ess", "perf/credit_s", "eval/gold", "reward/rule_length"} <= step_and_eval_keys
    missing = sorted(k for k in step_and_eval_keys if not _matches(k, documented))
    assert not missing, f"logged but not in docs/metrics.md: {missing}"
    logged = step_and_eval_keys | literal_metric_keys()
    stale = sorted(d for d in documented if not any(_matches(k, [d]) for k in logged))
    assert not stale, f"documented in docs/metrics.md but never logged: {stale}"


# ---- configuration ----------------------------------------------------------------------------


def test_every_config_field_has_a_description():
    fields = reference.config_fields()
    assert len(fields) > 80  # every leaf of the schema, nested ones included
    missing = [f.name for f in fields if not f.description]
    assert not missing, f"config fields with no YAML comment in configs/: {missing}"


def test_every_credit_field_has_a_description():
    missing = [f"{s.label}.{f.name}" for s in reference.scheme_infos() for f in s.fields if not f.description]
    assert not missing, f"credit fields with no comment (configs/credit/ or the params dataclass): {missing}"


def test_the_reference_takes_ranges_from_the_schema_and_defaults_from_the_composed_config():
    by_name = {f.name: f for f in reference.config_fields()}
    assert by_name["trainer.loss_agg"].valid == "`token-mean` | `seq-mean-token-mean` | `seq-mean-token-sum-norm`"
    assert by_name["trainer.lr"].valid == "> 0" and by_name["trainer.beta"].valid == ">= 0"
    assert by_name["trainer.top_p"].valid == "in (0, 1]"  # the message of validate()'s own check
    assert "2" in by_name["trainer.num_generations"].valid
    # configs/trainer/default.yaml sets 512 where the dataclass says 256: the run gets the YAML's
    assert by_name["trainer.eval_size"].default == 512
    assert by_name["trainer.eval_size"].source == "trainer/default.yaml"
    # only a non-default option sets it, so the schema's comment describes it (the option's describes its own value)
    assert by_name["policy.gguf_file"].source == "datc/config.py"


def test_descriptions_come_from_the_default_option_or_the_schema_before_other_options():
    # Before: reward.init read "start from the policy's weights" (reward/smollm2_rm.yaml's
    # init: policy) where the default is scratch; trainable_layers "train the top 6 of 30 blocks"
    # where the default 0 trains every layer.
    by_name = {f.name: f for f in reference.config_fields()}
    for name in ("reward.init", "reward.train.trainable_layers", "reward.train.test_prompts"):
        assert by_name[name].source == "datc/config.py", (name, by_name[name])
    assert by_name["reward.init"].description.startswith("scratch: ")
    assert "0: train every layer" in by_name["reward.train.trainable_layers"].description
    defaults = reference.default_options()
    schema = dict(reference._schema_comments())
    for f in by_name.values():  # a non-default option speaks only where neither the default option nor the schema does
        group, *rest = f.source.split("/")
        if rest and group in defaults and rest[0] != f"{defaults[group]}.yaml":
            assert f.name not in schema, (f.name, f.source)


def test_placeholders_in_comments_are_shown_not_taken_for_html():
    # Before: the groups table read `experiment/.yaml` (<name> was an HTML tag to Markdown).
    groups = {r[0]: r for r in _rendered_tables(reference.config_groups_md())[0][1:]}
    assert "experiment/<name>.yaml" in groups["experiment/"][3], groups["experiment/"]
    rows = {r[0]: r for table in _rendered_tables(reference.config_reference_md()) for r in table[1:]}
    assert "<results_dir>/<run_name>.json" in rows["results_dir"][4], rows["results_dir"]
    gcpo = next(i for i in reference.scheme_infos() if i.label == "gcpo")
    assert "&lt;" in reference.scheme_page_md(gcpo) or "<" not in gcpo.summary


def _rendered_tables(md: str) -> list[list[list[str]]]:
    """Every table of ``md`` as Python-Markdown (what the site uses) renders it: rows of cell
    texts, the header row first."""
    from html.parser import HTMLParser

    import markdown

    class Cells(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tables, self.cell = [], None

        def handle_starttag(self, tag, attrs):
            if tag == "table":
                self.tables.append([])
            elif tag == "tr":
                self.tables[-1].append([])
            elif tag in ("td", "th"):
                self.cell = []

        def handle_endtag(self, tag):
            if tag in ("td", "th"):
                self.tables[-1][-1].append("".join(self.cell))
                self.cell = None

        def handle_data(self, data):
            if self.cell is not None:
                self.cell.append(data)

    parser = Cells()
    parser.feed(markdown.markdown(md, extensions=["tables"]))
    return parser.tables


def _generated_pages() -> dict[str, str]:
    pages = {"reference/config.md": reference.config_reference_md(), "configuration groups": reference.config_groups_md(),
             "schemes/index.md": reference.schemes_table_md()}
    return pages | {f"schemes/{i.label}.md": reference.scheme_page_md(i) for i in reference.scheme_infos()}


def test_the_generated_tables_render_whole_rows_with_no_stray_escapes():
    from datc import config

    pages = _generated_pages()
    for name, md in pages.items():
        tables = _rendered_tables(md)
        assert tables or name.startswith("schemes/"), name  # a scheme without fields has no table
        for table in tables:
            width = len(table[0])
            for row in table:
                assert len(row) == width, f"{name}: a row of {len(row)} cells under a header of {width}: {row}"
                assert not any("\\" in cell for cell in row), f"{name}: a stray backslash in {row}"
    rows = {r[0]: r for table in _rendered_tables(pages["reference/config.md"]) for r in table[1:]}
    for field, choices in config.CHOICES.items():
        if field in rows:  # every choice in the field's own row, none lost to a split cell
            assert all(("null" if c is None else str(c)) in rows[field][3] for c in choices), (field, rows[field])
    assert rows["policy.dtype"][1] == "str" and "|" not in rows["trainer.lr"][1]


def test_the_table_check_sees_a_split_row():
    bad = "| a | b |\n|---|---|\n| `x` \\\\| `y` | z |\n"  # the old double escape: one row of three cells
    table = _rendered_tables(bad)[0]
    assert len(table[1]) != len(table[0]) or any("\\" in c for c in table[1])


def test_yaml_comments_follow_nesting_and_skip_lists(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("# @package _global_\n# header\ntrainer:\n  steps: 3  # rollout steps\n  rules:\n    - {name: a}  # item\n"
                 "top: 1  # a top field\nplain: 2\n")
    is_global, comments = reference.yaml_comments(p)
    assert is_global and comments == {"trainer.steps": "rollout steps", "top": "a top field"}


def test_notes_that_a_field_is_unused_do_not_describe_it():
    desc = reference.field_descriptions()
    assert not desc["logger.project"][0].lower().startswith("unused")  # logger/none.yaml says "unused without wandb"
    assert desc["logger.project"][1] == "logger/wandb.yaml"


# ---- credit schemes ---------------------------------------------------------------------------


def test_scheme_pages_cover_every_label_with_the_registry_facts():
    import dataclasses

    from datc.credit import CREDIT_SCHEMES
    from datc.credit.configs import credit_labels

    infos = {i.label: i for i in reference.scheme_infos()}
    assert sorted(infos) == credit_labels() and set(CREDIT_SCHEMES.names()) <= set(infos)
    for info in infos.values():
        assert [f.name for f in info.fields] == [f.name for f in dataclasses.fields(info.scheme.params)]
        page = reference.scheme_page_md(info)
        for heading in ("## Idea", "## Fields", "## Needs and normalization", "## Tests that pin it", "## Results"):
            assert heading in page, (info.label, heading)
    assert {f.name: f.value for f in infos["datc_unsigned"].fields}["direction"] == "unsigned"  # the config's value
    assert "`old_logps`" in reference.scheme_page_md(infos["prob_reweight"])
    own, other = reference.scheme_tests("entropy_top")
    assert own and all(t.startswith("tests/credit/test_entropy_top.py::") for t in own)
    assert not any(t.startswith("tests/credit/test_entropy_top.py") for t in other)
    table = reference.schemes_table_md()
    assert all(f"[`{label}`]({label}.md)" in table for label in infos)


# ---- commands and figures in the README and the getting-started page --------------------------

SHELL = ("bash", "sh", "console", "shell")
MARKER = re.compile(r"<!-- commands: (?P<how>[^>]*?) -->")


def command_blocks(path: Path) -> list[tuple[str, list[str]]]:
    """(the marker before it, its command lines) for each shell code block of a Markdown file;
    the marker is the HTML comment on the line before the fence ('' if there is none)."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w+)", lines[i])
        if m:
            j = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("```"))
            if m.group(1) in SHELL:
                before = lines[i - 1] if i else ""
                marker = MARKER.search(before)
                cmds = [ln for ln in lines[i + 1:j] if ln.strip() and not ln.lstrip().startswith("#")]
                out.append((marker["how"] if marker else "", cmds))
            i = j
        i += 1
    return out


def _entry_point(name: str) -> str | None:
    from importlib.metadata import entry_points

    return next((e.value for e in entry_points(group="console_scripts") if e.name == name), None)


def run_command(line: str) -> subprocess.CompletedProcess:
    """Run one shown command as the user would, its ``datc-*`` entry point from this checkout."""
    import shlex

    argv = shlex.split(line.split("  #")[0])
    target = _entry_point(argv[0])
    assert target, f"{argv[0]} is not a console script of this package"
    module, func = target.split(":")
    code = f"import sys; sys.argv[0] = {argv[0]!r}; from {module} import {func}; {func}()"
    return subprocess.run([sys.executable, "-c", code, *argv[1:]], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _test_exists(node: str) -> bool:
    file, _, name = node.partition("::")
    path = ROOT / file
    return path.exists() and any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.walk(ast.parse(path.read_text())))


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_every_command_shown_is_tested_or_marked_illustrative(page):
    blocks = command_blocks(ROOT / page)
    assert blocks, page
    for how, cmds in blocks:
        assert how, f"{page}: a shell block with no <!-- commands: ... --> marker: {cmds}"
        if how == "illustrative" or how.startswith("illustrative;"):
            continue
        if how == "ci":  # what CI runs: .ci/run's own command
            ci = (ROOT / ".ci" / "run").read_text()
            assert all(c.split("  #")[0].strip() in ci for c in cmds), cmds
        elif how == "run by tests/e2e/test_docs.py":  # run below, its output compared with the page's
            assert "\n".join(cmds) in [c.strip() for c, _ in _expected_outputs(ROOT / page)], cmds
        else:
            nodes = [n.strip() for n in how.removeprefix("tested by ").split(",")]
            assert how.startswith("tested by ") and all(_test_exists(n) for n in nodes), f"{page}: {how}"


def _expected_outputs(path: Path) -> list[tuple[str, str]]:
    """(command, expected output) pairs: a block marked ``run by tests/e2e/test_docs.py`` followed by
    a ``text`` block holding what it prints."""
    text = path.read_text()
    pattern = r"<!-- commands: run by tests/e2e/test_docs.py -->\n```bash\n(.*?)\n```\n+(?:[^\n`]*\n)*?```text\n(.*?)\n```"
    return [(c, o) for c, o in re.findall(pattern, text, flags=re.S)]


@pytest.mark.slow
def test_the_commands_run_here_print_what_the_page_shows():
    pairs = _expected_outputs(DOCS / "getting-started.md")
    assert pairs
    for cmds, expected in pairs:
        printed = []
        for line in [c for c in cmds.splitlines() if c.strip() and not c.startswith("#")]:
            r = run_command(line)
            printed += [ln for ln in (r.stdout + r.stderr).splitlines() if not ln.startswith("[")]  # no log lines
        for want in expected.splitlines():
            want = want.split(" ...")[0]  # a shown line may be cut with " ..."
            assert any(p.startswith(want) for p in printed), (want, printed)


def test_the_demo_output_shown_is_the_committed_summary():
    """The quick start's expected line is the one datc-train prints for results/demo/'s summary."""
    [summary_path] = [p for p in (ROOT / "results" / "demo").glob("*.json") if p.name != "numerics.json"]
    s = json.loads(summary_path.read_text())
    ev = s["eval"]
    line = (f"run {s['run_name']}: eval gold {ev['initial']['eval/gold']:.3f} -> {ev['final']['eval/gold']:.3f}, "
            f"rm score {ev['initial']['eval/rm_score']:.3f} -> {ev['final']['eval/rm_score']:.3f}")
    for page in ("README.md", "docs/getting-started.md"):
        text = (ROOT / page).read_text()
        assert line in text, page
        assert f"results/demo/{summary_path.name}" in text, page
    # The summary is the demo's run as configured today (a change to its settings renames the run);
    # that the code still computes its numbers is tests/e2e/test_train_e2e.py's fingerprint check.
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        demo = compose(config_name="train", overrides=["experiment=demo"])
    assert demo.run_name == s["run_name"] == summary_path.stem, (demo.run_name, s["run_name"])
    made = json.loads((ROOT / "results" / "demo" / "numerics.json").read_text())
    assert s["git_commit"].split("+")[0] == made["commit"].split("+")[0], "results/demo/numerics.json is not from the demo's commit"


def test_the_scheme_example_shown_is_the_tested_one():
    from tests.helpers.user_scheme import USER_MODULE

    code = [b for b in re.findall(r"```python\n(.*?)```", (DOCS / "writing-a-scheme.md").read_text(), flags=re.S)
            if "entropy_weighted" in b][0]
    shown = "\n".join(ln for ln in code.splitlines() if not ln.startswith("#")).strip()
    assert shown == USER_MODULE.strip()


# ---- figures ----------------------------------------------------------------------------------

FIGURE = re.compile(r"(?<![\w.`/-])[−-]?\d+\.\d+(?![\w.])")


def _paragraphs(text: str) -> list[str]:
    """Paragraphs, list items and table rows of a Markdown text, code blocks left out."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    parts = re.split(r"\n\s*\n|\n(?=\s*[-*] )|\n(?=\|)", text)
    return [p for p in parts if p.strip()]


def _numbers(path: Path) -> list[float]:
    text = path.read_text() if path.is_file() else ""
    return [float(x.replace("−", "-")) for x in re.findall(r"[−-]?\d+(?:\.\d+)?(?:e[−-]?\d+)?", text)]


def _held_by(figure: str, files: list[Path]) -> bool:
    value = float(figure.replace("−", "-"))
    places = len(figure.split(".")[1])
    return any(math.isclose(round(x, places), value, abs_tol=10 ** -places / 2) for f in files for x in _numbers(f))


def test_every_figure_in_the_readme_links_to_the_results_file_that_holds_it():
    readme = (ROOT / "README.md").read_text()
    checked = 0
    for para in _paragraphs(readme):
        figures = [f for f in FIGURE.findall(re.sub(r"\]\([^)]*\)|`[^`]*`|arXiv \d+\.\d+", "", para))]
        if not figures:
            continue
        links = [ROOT / link for link in re.findall(r"\]\((results/[^)#]+)\)", para)]
        assert links, f"figures {figures} with no link to results/: {para[:200]}"
        files = [f for link in links for f in ([link] if link.is_file() else sorted(link.parent.rglob("*")) if link.name == "README.md" else sorted(link.rglob("*")))]
        for fig in figures:
            assert _held_by(fig, files), f"{fig} is not in {[str(link.relative_to(ROOT)) for link in links]}: {para[:200]}"
            checked += 1


def test_the_figure_check_finds_an_unlinked_or_wrong_figure(tmp_path):
    held = tmp_path / "r.json"
    held.write_text('{"gold": 0.4542236328125, "ratio": 1.127}')
    assert _held_by("0.454", [held]) and _held_by("1.13", [held]) and not _held_by("0.46", [held])
    paras = _paragraphs("Gold rose to 0.454 ([r](results/r.json)).\n\n- a bullet with 2.5 and no link\n")
    assert len(paras) == 2 and FIGURE.findall(paras[1]) == ["2.5"]


def test_the_readme_is_short_and_has_no_commit_stamps():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 210
    assert not re.search(r"\bcommit `?[0-9a-f]{7}\b", readme)
    assert "make test" in readme and "Â_{i,t} = A_i · w_{i,t}" in readme


def test_the_reliability_page_states_its_own_row_count():
    # It said 63 rows when its table held 65.
    text = (DOCS / "reliability.md").read_text()
    table = text.split("| fault | what datc does | test |", 1)[1].split("\n\n", 1)[0]
    rows = [ln for ln in table.splitlines() if ln.startswith("| ")]
    stated = re.search(r"\((\d+) rows\)", text)
    assert stated and int(stated.group(1)) == len(rows), (stated and stated.group(1), len(rows))
