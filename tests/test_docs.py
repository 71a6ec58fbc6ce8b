"""The user docs (docs/): the config reference is what the schemas make now, links lead somewhere, and the
config keys the pages name exist."""

import dataclasses
import re
import typing
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hpcrl.config import reference
from hpcrl.config.checks import check_cluster
from hpcrl.config.schema import ClusterConfig, Config
from tests.conftest import REPO

DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))
SECTIONS = {f.name for f in dataclasses.fields(Config)}
_LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")  # [text](file.md#anchor), [text](#anchor)
_KEY = re.compile(r"`([a-z_]+(?:\.(?:[a-z_0-9]+|<[a-z]+>))+)")  # `cluster.net.port_min`, `cluster.roles.<role>`


def test_the_config_reference_is_what_the_schemas_make():
    assert (DOCS / "config.md").read_text() == reference.reference(), (
        f"docs/config.md is stale (the schema changed): run `{reference.COMMAND}`"
    )


def test_every_schema_field_is_in_the_reference():
    text = reference.reference()
    for name in SECTIONS:
        assert f"\n## {name}\n" in text, f"the section {name} is missing from the config reference"
    for cls in _nested(Config):
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text, f"{cls.__name__}.{f.name} is missing from the config reference"


def test_a_field_without_a_comment_is_named():
    source = "from dataclasses import dataclass\n@dataclass\nclass A:\n    x: int = 1  # one\n    y: int = 2\n"
    assert reference.field_comments(source) == {("A", "x"): "one", ("A", "y"): ""}

    @dataclasses.dataclass
    class A:
        x: int = 1
        y: int = 2

    with pytest.raises(ValueError, match=r"A\.y in hpcrl/config/schema.py has no comment"):
        reference.sections(A, A(), "a", "", reference.field_comments(source))


def test_markup_in_comments_is_escaped_outside_code():
    assert reference.escape_text("a | b, <root>/x, `c | d`") == r"a \| b, \<root>/x, `c \| d`"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_lead_to_files_and_headings(page: Path):
    for target, fragment in _LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        linked = page.parent / target if target else page
        assert linked.exists(), f"{page.name} links to {target}, which does not exist"
        if fragment and linked.suffix == ".md":
            assert fragment in _anchors(linked), f"{page.name} links to {target}#{fragment}: no such heading"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_config_keys_named_in_the_docs_exist(page: Path):
    for key in _KEY.findall(page.read_text()):
        if key.split(".")[0] in SECTIONS:
            assert _exists(key), f"{page.name} names `{key}`, which is not a config key (hpcrl/config/schema.py)"


def test_the_site_file_example_is_a_valid_cluster_config():
    (example,) = re.findall(r"```yaml\n# conf/cluster/mysite.yaml\n(.*?)```", (DOCS / "slurm.md").read_text(), re.S)
    cluster = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ClusterConfig), OmegaConf.create(example)))
    check_cluster(cluster)
    assert (cluster.kind, cluster.net.interface) == ("slurm", "ib0")


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings (outside fenced code, where "#" starts a comment)."""
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("#"):
            anchors.add(reference.anchor(line.lstrip("#").strip()))
    return anchors


def _exists(key: str) -> bool:
    node: typing.Any = Config
    for part in key.split("."):
        origin = typing.get_origin(node)
        if origin is dict:  # cluster.roles.<role>: any key, then the value's fields
            node = typing.get_args(node)[1]
            continue
        if not dataclasses.is_dataclass(node):
            return False
        hints = typing.get_type_hints(node)
        if part not in hints:
            return False
        node = hints[part]
    return True


def _nested(cls: type) -> set[type]:
    found: set[type] = set()
    for hint in typing.get_type_hints(cls).values():
        for t in (hint, *typing.get_args(hint)):
            if isinstance(t, type) and dataclasses.is_dataclass(t):
                found |= {t, *_nested(t)}
    return found
