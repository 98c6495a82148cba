"""MkDocs hooks (``hooks:`` in ``mkdocs.yml``): the generated pages and the results folders join
the site at build time, so nothing generated is committed and nothing can drift.

- ``reference/config.md``: the configuration reference (:func:`reference.config_reference_md`);
- ``schemes/<label>.md``: one page per credit label, and the table in ``schemes/index.md``
  (the ``{{ schemes_table }}`` marker), and the config groups' table
  (``{{ config_groups }}``, in ``configuration.md``);
- ``api/<module>.md``: each pure module's API, rendered by mkdocstrings from its docstrings;
- ``results/...``: the committed results, served from the repository's own folder, so the pages
  link to the files that hold each figure.

Run from the repository root (``python -m mkdocs build``, as ``make docs`` does) so that
``scripts.docs`` imports.
"""

from __future__ import annotations

from mkdocs.structure.files import File, Files
from mkdocs.structure.nav import Navigation, Section
from mkdocs.structure.pages import Page

from scripts.docs import reference

MARKERS = {  # a marker in a hand-written page -> the generated Markdown that replaces it
    "{{ schemes_table }}": reference.schemes_table_md,
    "{{ config_groups }}": reference.config_groups_md,
}


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "reference/config.md", content=reference.config_reference_md()))
    for info in reference.scheme_infos():
        files.append(File.generated(config, f"schemes/{info.label}.md", content=reference.scheme_page_md(info)))
    api_index = ["# API of the pure modules", "",
                 "Rendered from the docstrings of the modules that hold no model, config or I/O (the math "
                 "a scheme or a test builds on) and of the credit interface.", ""]
    for module in reference.API_MODULES:
        files.append(File.generated(config, f"api/{module}.md", content=f"# `{module}`\n\n::: {module}\n"))
        api_index.append(f"- [`{module}`]({module}.md)")
    files.append(File.generated(config, "api/index.md", content="\n".join(api_index) + "\n"))
    for path in sorted(reference.RESULTS.rglob("*")):
        if path.is_file():
            files.append(File(str(path.relative_to(reference.ROOT)), src_dir=str(reference.ROOT),
                              dest_dir=config["site_dir"], use_directory_urls=config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page: Page, config, files: Files) -> str:
    for marker, make in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown


def on_nav(nav: Navigation, config, files: Files) -> Navigation:
    """The generated scheme and API pages go under their sections of the hand-written nav."""
    groups = {
        "schemes/": [f"schemes/{i.label}.md" for i in reference.scheme_infos()],
        "api/": [f"api/{m}.md" for m in reference.API_MODULES],
    }
    for item in nav.items:
        if not isinstance(item, Section):
            continue
        for prefix, uris in groups.items():
            if any(getattr(child, "file", None) and child.file.src_uri.startswith(prefix) for child in item.children):
                for uri in uris:
                    file = files.get_file_from_path(uri)
                    page = file.page or Page(None, file, config)
                    page.parent = item
                    item.children.append(page)
                    nav.pages.append(page)
    return nav
