"""The docs stay true: the supported-models page against the coverage sweep, and the
README's set-up commands and links.

The page (docs/models.md) is rendered from docs/models.json by docs/gen_models.py. The
default run checks the page against its results, that every type of the sweep's
representative set has a row, and recomputes one type's row (llama); the slow run
recomputes every representative row. `mkdocs build --strict` (in .ci/run) checks the
links and the API reference.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from tests.engine.coverage import REPRESENTATIVE

REPO = Path(__file__).resolve().parents[1]


def _gen_models():
    spec = importlib.util.spec_from_file_location("gen_models", REPO / "docs" / "gen_models.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_models"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gen_models = _gen_models()


def _stale(types: list[str]) -> list[str]:
    """Rows of ``types`` whose recomputed value differs from the page's, described."""
    recorded = gen_models.load_rows()
    return [f"{row.model_type}: page has {recorded.get(row.model_type)}, the sweep gives {row}"
            for row in gen_models.sweep_rows(types, echo=lambda line: None) if recorded.get(row.model_type) != row]


def test_models_page_is_rendered_from_the_recorded_sweep():
    assert gen_models.PAGE.read_text() == gen_models.render(gen_models.load_rows()), \
        "docs/models.md was edited by hand or not re-rendered: python docs/gen_models.py --render"


def test_models_page_has_a_row_for_every_representative_type():
    missing = sorted(set(REPRESENTATIVE) - set(gen_models.load_rows()))
    assert not missing, f"no row for {missing}: python docs/gen_models.py --types {' '.join(missing)}"


def test_models_page_row_matches_the_sweep_for_llama():
    stale = _stale(["llama"])
    assert not stale, "\n".join(stale) + "\nregenerate: python docs/gen_models.py --fast"


@pytest.mark.slow
def test_models_page_rows_match_the_sweep_for_the_representative_set():
    stale = _stale(list(REPRESENTATIVE))
    assert not stale, "\n".join(stale) + "\nregenerate: python docs/gen_models.py --fast"


def test_readme_keeps_the_two_set_up_commands():
    readme = (REPO / "README.md").read_text()
    assert ('python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[prefect]" '
            '&& shardline demo') in readme
    assert '. .venv/bin/activate && pip install -e ".[prefect,test]" && python -m pytest -q' in readme


def test_readme_links_point_at_files_that_exist():
    readme = (REPO / "README.md").read_text()
    targets = [target for target in re.findall(r"\]\(([^)#]+)\)", readme) if "://" not in target]
    assert targets
    missing = [target for target in targets if not (REPO / target).exists()]
    assert not missing, f"README links to missing files: {missing}"
