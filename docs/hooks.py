"""MkDocs hooks (mkdocs.yml ``hooks:``) that keep the API reference tied to the code.

- The package's source folders install under other names (pyproject's package-dir
  maps ``engine/`` to ``shardline.engine``, ...), which mkdocstrings' static reader
  cannot follow. ``on_config`` lays the sources out as the installed package tree in
  build/docs-api, where mkdocs.yml points the Python handler, so docstrings are read from
  the source without importing torch or Airflow.
- ``<!-- shardline:public-api -->`` on a page becomes one ``:::`` block per name that
  ``shardline/__init__.py`` re-exports (read from its ``_EXPORTS`` table), so the
  reference follows the re-exports when a module moves.
- ``<!-- shardline:cli-help -->`` becomes the CLI's ``--help`` text for each command,
  taken from the parser itself.
"""

from __future__ import annotations

import argparse
import ast
import shutil
from pathlib import Path
from typing import Any

import tomllib

from shardline.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
PUBLIC_API_MARKER = "<!-- shardline:public-api -->"
CLI_HELP_MARKER = "<!-- shardline:cli-help -->"
# The installed package tree, rebuilt on every build (build/ is git-ignored).
API_TREE = REPO / "build" / "docs-api"


def installed_layout(target: Path) -> Path:
    """Copy the package's Python sources under ``target`` in the tree they install as
    (pyproject's package-dir); griffe does not follow symlinked folders."""
    package_dir: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    for name, source in package_dir.items():
        destination = target.joinpath(*name.split("."))
        destination.mkdir(parents=True, exist_ok=True)
        for entry in (REPO / source).glob("*.py"):
            shutil.copy2(entry, destination / entry.name)
    return target


def public_exports() -> dict[str, str]:
    """``shardline/__init__.py``'s ``_EXPORTS``: public name -> defining module."""
    tree = ast.parse((REPO / "shardline" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError("shardline/__init__.py defines no _EXPORTS table")


def public_api_markdown() -> str:
    blocks = []
    for name, module in public_exports().items():
        blocks.append(f"## `shardline.{name}`\n\n`from shardline import {name}` (defined in `{module}`)\n\n"
                      f"::: {module}.{name}\n    options:\n      show_root_heading: false\n")
    return "\n".join(blocks)


def cli_help_markdown() -> str:
    parser = build_parser()
    sections = [("shardline", parser.format_help())]
    for action in parser._actions:  # argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            sections += [(f"shardline {name}", sub.format_help()) for name, sub in action.choices.items()]
    return "\n".join(f"## `{title}`\n\n```text\n{text.rstrip()}\n```\n" for title, text in sections)


def on_startup(**_: Any) -> None:
    # Before any plugin's configuration: the python handler resolves its ``paths``
    # (mkdocs.yml: build/docs-api) when it is set up, so the folder must exist by then.
    _refresh_api_tree()


def on_pre_build(**_: Any) -> None:
    _refresh_api_tree()  # `mkdocs serve` rebuilds after source edits


def _refresh_api_tree() -> None:
    shutil.rmtree(API_TREE, ignore_errors=True)
    installed_layout(API_TREE)


def on_page_markdown(markdown: str, **_: Any) -> str:
    if PUBLIC_API_MARKER in markdown:
        markdown = markdown.replace(PUBLIC_API_MARKER, public_api_markdown())
    if CLI_HELP_MARKER in markdown:
        markdown = markdown.replace(CLI_HELP_MARKER, cli_help_markdown())
    return markdown
