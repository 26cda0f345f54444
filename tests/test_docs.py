"""docs/: every `file:function` link names something that exists, every README feature-table row
has a row of links in docs/architecture.md, and no file cites documents outside the repository."""

import ast
import os
import re

import pytest

from tests.helpers import REPO

DOCS = os.path.join(REPO, "docs")
# [`path/to/file.py:Name.attr`](../path/to/file.py)
LINK = re.compile(r"\[`([\w/]+\.py):([\w.]+)`\]\(([^)]+)\)")


def _read(*parts) -> str:
    with open(os.path.join(REPO, *parts)) as f:
        return f.read()


def _defined_names(path: str) -> set[str]:
    """Top-level functions, classes and assigned names, and `Class.method` for methods."""
    names = set()
    for node in ast.parse(_read(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names.update(f"{node.name}.{item.name}" for item in node.body
                             if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _links(doc: str) -> list[tuple[str, str, str]]:
    return LINK.findall(_read("docs", doc))


def _check_link(path: str, name: str, target: str) -> str | None:
    """None if the link is good, else what is wrong with it."""
    resolved = os.path.relpath(os.path.normpath(os.path.join(DOCS, target)), REPO)
    if resolved != path:
        return f"{path}:{name} links to {target} (= {resolved})"
    if not os.path.isfile(os.path.join(REPO, path)):
        return f"{path} does not exist"
    if name not in _defined_names(path):
        return f"{path} defines no {name}"
    return None


def test_the_link_checker_rejects_bad_links():
    assert _check_link("dsv3_jax/ops/routing.py", "route", "../dsv3_jax/ops/routing.py") is None
    assert "defines no" in _check_link("dsv3_jax/ops/routing.py", "no_such_function", "../dsv3_jax/ops/routing.py")
    assert "does not exist" in _check_link("dsv3_jax/ops/nothing.py", "route", "../dsv3_jax/ops/nothing.py")
    assert "links to" in _check_link("dsv3_jax/ops/routing.py", "route", "../dsv3_jax/ops/dispatch.py")


@pytest.mark.parametrize("doc", ["architecture.md"])
def test_every_file_function_link_exists(doc):
    links = _links(doc)
    assert len(links) > 50
    problems = [p for p in (_check_link(*link) for link in links) if p]
    assert not problems, "\n".join(problems)


def _feature_labels() -> list[str]:
    """The README feature table's first cells up to the first ':' (or '(' when there is none)."""
    table = _read("README.md").split("## What works today", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|")][2:]  # header, separator
    cells = [row.split("|")[1].strip() for row in rows]
    return [cell.split(":", 1)[0].strip() if ":" in cell else cell.split("(", 1)[0].strip() for cell in cells]


def test_architecture_covers_every_feature_table_row():
    labels = _feature_labels()
    assert len(labels) >= 18
    doc = _read("docs", "architecture.md")
    coverage = doc.split("## The README's feature table -> code", 1)[1]
    rows = {line.split("|")[1].strip(): line for line in coverage.splitlines() if line.startswith("| ")}
    missing = [label for label in labels if label not in rows]
    assert not missing, f"docs/architecture.md has no feature-table row for {missing}"
    unlinked = [label for label in labels if not LINK.search(rows[label])]
    assert not unlinked, f"rows without a file:function link: {unlinked}"


# A design note or a sibling folder beside the checkout: neither ships with the repository.
OUTSIDE_CITATION = re.compile(r"DESIGN\.md|\.\./shared")


def test_no_file_cites_documents_outside_the_repository():
    cited = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "runs")]
        for f in files:
            if f.endswith((".py", ".md")):
                text = _read(os.path.relpath(os.path.join(root, f), REPO))
                if OUTSIDE_CITATION.search(text):
                    cited.append(os.path.relpath(os.path.join(root, f), REPO))
    assert not cited


def test_quantization_doc_links_exist():
    links = _links("quantization.md")
    assert links
    bad = [b for b in (_check_link(*link) for link in links) if b]
    assert not bad, bad
