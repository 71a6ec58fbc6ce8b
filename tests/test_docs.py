"""The user docs (README.md, docs/, the comments in hpcrl/conf's YAML files): the config reference is what the
schemas make now, links lead somewhere, and the config keys, group options and ``python -m hpcrl.*`` commands
they name exist."""

import dataclasses
import importlib.util
import re
import typing
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hpcrl.config import reference
from hpcrl.config.checks import check_cluster
from hpcrl.config.schema import ClusterConfig, Config
from tests.conftest import CONF_DIR, REPO

DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))
TEXTS = [REPO / "README.md", *PAGES]  # what users read: README.md and docs/
CONF_YAML = sorted(CONF_DIR.rglob("*.yaml"))
SECTIONS = {f.name for f in dataclasses.fields(Config)}
GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")
_LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")  # [text](file.md#anchor), [text](#anchor)
_KEY = re.compile(r"`([a-z_]+(?:\.(?:[a-z_0-9]+|<[a-z]+>))+)")  # `cluster.net.port_min`, `cluster.roles.<role>`
# in a YAML comment keys are written bare: "set dataset.train_files=[...]", "cluster.gpus_per_node=N"
_BARE_KEY = re.compile(rf"(?<![\w./-])((?:{'|'.join(SECTIONS)})(?:\.(?:[a-z_0-9]+|<[a-z]+>))+)")
_OPTION = re.compile(rf"(?<![\w./-])({'|'.join(GROUPS)})=([\w:+,.]+)")  # experiment=gsm8k, algorithm=grpo,dapo
_COMMAND = re.compile(r"python3? -m (hpcrl(?:\.\w+)*)(?!\.\.)")  # not `python -m hpcrl...`
FILE_NAMES = ("jsonl", "json", "png", "yaml", "log", "md", "py", "sh")  # metrics.jsonl is a file, not a key of metrics
# options of a user's own, which the docs show how to write (docs/slurm.md: a site file)
EXAMPLE_OPTIONS = {("cluster", "mysite")}


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


@pytest.mark.parametrize("page", TEXTS, ids=[p.name for p in TEXTS])
def test_config_keys_named_in_the_docs_exist(page: Path):
    for key in _KEY.findall(page.read_text()):
        if key.split(".")[0] in SECTIONS and not _is_file_name(key):
            assert _exists(key), f"{page.name} names `{key}`, which is not a config key (hpcrl/config/schema.py)"


@pytest.mark.parametrize("page", TEXTS, ids=[p.name for p in TEXTS])
def test_group_options_named_in_the_docs_exist(page: Path):
    for group, option in _options(_without_error_examples(page.read_text())):
        assert option in _group_options(group), f"{page.name} names {group}={option}, which is no option of {group}"


@pytest.mark.parametrize("page", TEXTS, ids=[p.name for p in TEXTS])
def test_commands_named_in_the_docs_exist(page: Path):
    for module in _COMMAND.findall(page.read_text()):
        assert _runnable(module), f"{page.name} names `python -m {module}`, which is no runnable module of hpcrl"


@pytest.mark.parametrize("path", CONF_YAML, ids=lambda p: str(p.relative_to(CONF_DIR)))
def test_what_the_yaml_comments_name_exists(path: Path):
    comments = "\n".join(line.partition("#")[2] for line in path.read_text().splitlines() if "#" in line)
    where = path.relative_to(REPO)
    for key in _BARE_KEY.findall(comments):
        if not _is_file_name(key):
            assert _exists(key), f"{where}'s comments name {key}, which is not a config key"
    for group, option in _options(comments):
        assert option in _group_options(group), f"{where}'s comments name {group}={option}, which is no option"
    for module in _COMMAND.findall(comments):
        assert _runnable(module), f"{where}'s comments name `python -m {module}`, which is no runnable module"


def test_the_readme_group_table_lists_every_option_of_every_group():
    """README's table of groups: each group's options, as conf/ has them, no more and no fewer."""
    text = (REPO / "README.md").read_text()
    table = text[text.index("| group | options |") :].split("\n\n")[0]
    rows = {group: options for group, options in re.findall(r"^\| `(\w+)` \| (.*?) \|", table, re.M)}
    assert sorted(rows) == GROUPS, "README's group table and hpcrl/conf's groups differ"
    for group, cell in rows.items():
        named = {o for o in re.findall(r"`([\w]+)`", cell)}
        assert named == _group_options(group), f"README lists {sorted(named)} for {group}"


def test_the_docs_checks_catch_what_does_not_exist():
    text = "`train.lrate=1` and `dataset.name`, `experiment=gsm8` or algorithm=grpo,dapoo; python -m hpcrl.trainer"
    shown_failing = "$ python -m hpcrl.main experiment=gsm9\nhpcrl: config error: experiment='gsm9' is invalid"
    assert _options(_without_error_examples(f"{text}\n{shown_failing}")) == _options(text)
    assert [k for k in _KEY.findall(text) if not _exists(k)] == ["train.lrate"]
    missing = [(g, o) for g, o in _options(text) if o not in _group_options(g)]
    assert missing == [("experiment", "gsm8"), ("algorithm", "dapoo")]
    assert [m for m in _COMMAND.findall(text) if not _runnable(m)] == ["hpcrl.trainer"]
    assert _is_file_name("metrics.jsonl") and not _is_file_name("metrics.loggers")
    assert _runnable("hpcrl.main") and _runnable("hpcrl.doctor") and not _runnable("hpcrl.config")


def test_the_site_file_example_is_a_valid_cluster_config():
    (example,) = re.findall(r"```yaml\n# conf/cluster/mysite.yaml\n(.*?)```", (DOCS / "slurm.md").read_text(), re.S)
    cluster = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ClusterConfig), OmegaConf.create(example)))
    check_cluster(cluster)
    assert (cluster.kind, cluster.net.interface) == ("slurm", "ib0")


def _without_error_examples(text: str) -> str:
    """``text`` without the commands shown failing: a ``$ python -m ...`` line followed by the error it prints."""
    lines = text.splitlines()
    failing = {i for i, line in enumerate(lines[:-1]) if line.startswith("$ ") and "error" in lines[i + 1]}
    return "\n".join(line for i, line in enumerate(lines) if i not in failing)


def _is_file_name(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in FILE_NAMES


def _options(text: str) -> list[tuple[str, str]]:
    """(group, option) for each ``group=option`` in ``text``: every option of a sweep, not a shorthand
    (``allocation=sglang:d4t2+fsdp:d8``), nor a placeholder in capitals (``cluster=SITE``), nor a user's example."""
    found = []
    for group, value in _OPTION.findall(text):
        for option in value.rstrip(".,").split(","):
            if ":" in option or not option or option.isupper() or (group, option) in EXAMPLE_OPTIONS:
                continue
            found.append((group, option))
    return found


def _group_options(group: str) -> set[str]:
    return {p.stem for p in (CONF_DIR / group).glob("*.yaml")}


def _runnable(module: str) -> bool:
    """``python -m module`` runs something: a module, or a package with a ``__main__``."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return False
    if spec is None:
        return False
    if spec.submodule_search_locations is None:
        return True
    return importlib.util.find_spec(f"{module}.__main__") is not None


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
