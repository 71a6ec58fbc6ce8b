"""The user docs (README.md, docs/, the comments in hpcrl/conf's YAML files): the config reference is what the
schemas make now, links lead somewhere, the config keys, group options and ``python -m hpcrl.*`` commands they
name exist, every summary line shown has the keys a run prints, what they say of an allocation preset is what it
is, and a site file goes where the docs say, outside the package, and is found there."""

import ast
import dataclasses
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from hpcrl.config import format_spec, reference
from hpcrl.config.checks import check_cluster
from hpcrl.config.schema import AllocationConfig, ClusterConfig, Config
from tests.config.compose import load
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
# where the summary line python -m hpcrl.main prints is built (the loop's dict, the job's additions, main's print)
SUMMARY_SOURCES = [REPO / "hpcrl" / "main.py", *sorted((REPO / "hpcrl" / "controller").glob("*.py"))]
PRESETS = sorted(p.stem for p in (CONF_DIR / "allocation").glob("*.yaml"))
_PRESET = re.compile(rf"(?<![\w-])({'|'.join(PRESETS)})(?![\w-])")
# "`sglang:d4t2+fsdp:d8` is `2node_16gpu`"; a row of docs/slurm.md's table: "| `1node_8gpu` | `sglang:d2t2+fsdp:d4` |"
_SAID_TO_BE = re.compile(r"`(?:allocation=)?([a-z]+:[\w:+]+)` is\s+`(\w+)`")
_TABLE_ROW = re.compile(r"^\| `(\w+)`(?: \(default\))? \| `([a-z]+:[\w:+]+)` \|", re.M)
_NUMBER = r"(\d+|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen|sixteen)"
_COUNTS = {  # what a sentence says of a preset's roles: "two SGLang servers", "4 FSDP ranks", "tensor-parallel size 2"
    "server.workers": re.compile(rf"\b{_NUMBER} (?:(?:SGLang|CPU|inference) ){{0,2}}servers?\b", re.I),
    "trainer.workers": re.compile(rf"\b{_NUMBER} (?:FSDP|trainer|CPU) ranks?\b", re.I),
    "server.tp_size": re.compile(rf"\btensor-parallel(?: size)? {_NUMBER}\b", re.I),
}
# docs/slurm.md's site file: "```yaml\n# ~/hpcrl-site/cluster/mysite.yaml\n..."
_SITE_FILE = re.compile(r"```yaml\n# (\S+)/cluster/(\w+)\.yaml\n(.*?)```", re.S)
_CONF_PATH = re.compile(r"(?<![\w.~/$-])((?:hpcrl/)?conf/[\w<>./-]*)")  # conf/cluster/<site>.yaml, hpcrl/conf/
_CONFIG_DIR = re.compile(r"(?:--config-dir|-cd)[= ](\S+)|hydra\.searchpath=\[file://([^],]+)")


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
    ((_, _, example),) = _SITE_FILE.findall((DOCS / "slurm.md").read_text())
    cluster = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ClusterConfig), OmegaConf.create(example)))
    check_cluster(cluster)
    assert (cluster.kind, cluster.net.interface) == ("slurm", "ib0")


@pytest.mark.parametrize("page", TEXTS, ids=[p.name for p in TEXTS])
def test_every_summary_line_shown_has_the_keys_a_run_prints(page: Path):
    always, sometimes = summary_keys()
    assert {"steps", "run_dir"} <= always, "the summary's keys were not found in SUMMARY_SOURCES: did it move?"
    for shown in _summary_lines(page.read_text()):
        missing, unknown = sorted(always - set(shown)), sorted(set(shown) - always - sometimes)
        assert not missing and not unknown, (
            f"{page.name} shows a summary line without {missing} and with {unknown}: a run prints {sorted(always)}"
            f" (some runs also {sorted(sometimes)})"
        )


def test_the_first_runs_summary_is_shown():
    for page in (REPO / "README.md", DOCS / "quickstart.md"):
        assert _summary_lines(page.read_text()), f"{page.name} shows no summary line (or _summary_lines misses it)"


def test_the_allocation_table_lists_every_preset_with_its_shorthand():
    rows = dict(_TABLE_ROW.findall((DOCS / "slurm.md").read_text()))
    assert sorted(rows) == PRESETS, "docs/slurm.md's allocation table and hpcrl/conf/allocation differ"


@pytest.mark.parametrize("page", TEXTS, ids=[p.name for p in TEXTS])
def test_a_shorthand_said_to_be_a_preset_is_it(page: Path):
    text = page.read_text()
    for spec, preset in [*_SAID_TO_BE.findall(text), *((spec, preset) for preset, spec in _TABLE_ROW.findall(text))]:
        assert _allocation(f"allocation.spec={spec}") == _allocation(f"allocation={preset}"), (
            f"{page.name} says {spec} is {preset}, which is {_allocation(f'allocation={preset}')}"
        )


@pytest.mark.parametrize("path", [*TEXTS, *CONF_YAML], ids=lambda p: str(p.relative_to(REPO)))
def test_the_counts_said_of_a_preset_are_its_counts(path: Path):
    """A sentence (or table row) naming one preset says its servers, ranks and tensor-parallel size right; in a
    preset's own YAML the comments speak of it."""
    text = path.read_text() if path.suffix == ".md" else _comments(path)
    own = path.stem if path.parent.name == "allocation" and path.suffix == ".yaml" else None
    for sentence in _sentences(text):
        named = set(_PRESET.findall(sentence)) or ({own} if own else set())
        if len(named) != 1:
            continue
        (preset,) = named
        for field, said in _counts_said(sentence).items():
            actual = _allocation_field(preset, field)
            assert said == actual, f"{path.name} says {field}={said} of {preset}, which has {actual}: {sentence!r}"


@pytest.mark.parametrize("path", [*TEXTS, *CONF_YAML], ids=lambda p: str(p.relative_to(REPO)))
def test_the_docs_put_no_file_of_a_users_in_the_package(path: Path):
    """A path under conf/ or hpcrl/conf/ that the docs (or the YAML comments) name is one hpcrl ships (a site file
    there would be lost with the package, or land in a checkout's); a directory they give to --config-dir or
    hydra.searchpath is the user's own: a placeholder (DIR), or one in their home or at an absolute path, outside
    the package."""
    text = path.read_text() if path.suffix == ".md" else _comments(path)
    for named in _CONF_PATH.findall(text):
        shipped = CONF_DIR / named.removeprefix("hpcrl/").removeprefix("conf").strip("/")
        assert shipped.exists(), f"{path.name} names {named}: no file of hpcrl's; a user's own goes in --config-dir DIR"
    for given in _CONFIG_DIR.findall(text):
        where = (given[0] or given[1]).strip("`'\".,;)")
        assert _a_users_directory(where), f"{path.name} gives {where} as a config directory: not one of the user's"


def test_a_site_file_where_the_docs_put_it_is_found_by_the_command_they_give(tmp_path):
    """docs/slurm.md's steps, in a checkout as a user types them (~ a home of the test's): the copy of the template
    lands where the page says, the example filled in there is what a dry run with the page's --config-dir
    composes, and nothing is written into the package."""
    text = (DOCS / "slurm.md").read_text()
    ((where, name, example),) = _SITE_FILE.findall(text)
    assert where.startswith("~/"), f"docs/slurm.md puts the site file in {where}: a directory of the user's home"
    commands = [line for line in text.splitlines() if line.startswith("python -m ") and f"cluster={name}" in line]
    assert commands and all(f"--config-dir {where} " in line for line in commands), commands
    home, site_file = tmp_path / "home", tmp_path / "home" / where[2:] / "cluster" / f"{name}.yaml"
    (copy,) = [block for block in re.findall(r"```bash\n(.*?)```", text, re.S) if "cp " in block]
    assert _shell(copy, home).returncode == 0
    assert site_file.read_text() == (CONF_DIR / "cluster" / "slurm.yaml").read_text()
    site_file.write_text(example)
    result = _shell(f"python -m hpcrl.main --config-dir {where} cluster={name} run.dry_run=true "
                    f"run.root={tmp_path / 'runs'}", home)  # fmt: skip
    assert result.returncode == 0, result.stderr
    cluster = yaml.safe_load(result.stdout)["cluster"]
    assert (cluster["name"], cluster["partition"], cluster["net"]["interface"]) == (name, "gpu", "ib0")
    assert not list(CONF_DIR.rglob(f"{name}.yaml"))


def test_the_docs_checks_read_summaries_allocations_and_config_dirs():
    source = "summary = {'a': 1}\nif x:\n    summary['b'] = 2\nsummary['c'] = 3\nr = {**summary, 'd': 4} if y else 0\n"
    assert _summary_keys_in(ast.parse(source)) == ({"a", "c"}, {"b", "d"})
    shown = '```\n{"steps": 5, "run_dir": "r"}\n{"question": "1+1?", "answer": "2"}\n```'
    assert _summary_lines(shown) == [{"steps": 5, "run_dir": "r"}]
    sentence = "`1node_8gpu` puts two SGLang servers of tensor-parallel size 2 and 4 FSDP ranks on one box; a critic"
    assert _counts_said(sentence) == {"server.workers": 2, "trainer.workers": 4, "server.tp_size": 2}
    assert _counts_said("One CPU inference server and one trainer rank") == {"server.workers": 1, "trainer.workers": 1}
    assert _allocation_field("1node_8gpu", "server.tp_size") == 2
    assert _SAID_TO_BE.findall("`allocation=cpu:d1+fsdp:d2g0` is\n`cpu_tiny`") == [("cpu:d1+fsdp:d2g0", "cpu_tiny")]
    assert _allocation("allocation.spec=cpu:d1+fsdp:d2g0") != _allocation("allocation=cpu_tiny")
    paths = "copy it to `conf/cluster/<site>.yaml` from `hpcrl/conf/cluster/slurm.yaml`, not DIR/conf/x"
    assert _CONF_PATH.findall(paths) == ["conf/cluster/<site>.yaml", "hpcrl/conf/cluster/slurm.yaml"]
    dirs = "--config-dir conf, -cd=~/site, --config-dir DIR, hydra.searchpath=[file:///home/me/site]"
    given = [a or b for a, b in _CONFIG_DIR.findall(dirs)]
    assert [_a_users_directory(d.rstrip(",")) for d in given] == [False, True, True, True]
    assert not _a_users_directory(str(CONF_DIR)) and not _a_users_directory("hpcrl/conf")


@functools.cache
def summary_keys() -> tuple[set[str], set[str]]:
    """The keys of the summary line ``python -m hpcrl.main`` prints, read from the code that builds it
    (SUMMARY_SOURCES): (every run's keys, some runs' keys)."""
    always: set[str] = set()
    sometimes: set[str] = set()
    for path in SUMMARY_SOURCES:
        found = _summary_keys_in(ast.parse(path.read_text()))
        always |= found[0]
        sometimes |= found[1]
    return always, sometimes - always


def _summary_keys_in(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The string keys the code sets on a dict named ``summary``: its literal (``summary = {...}``),
    ``summary[KEY] = ...`` and ``{**summary, KEY: ...}``; those set under an ``if`` or in a conditional expression
    are some runs' (``resumed_from_step``: a resumed run's)."""
    always: set[str] = set()
    sometimes: set[str] = set()

    def visit(node: ast.AST, conditional: bool) -> None:
        (sometimes if conditional else always).update(_keys_set_on_summary(node))
        for child in ast.iter_child_nodes(node):
            branch = isinstance(node, (ast.If, ast.IfExp)) and child is not node.test
            visit(child, conditional or branch)

    visit(tree, False)
    return always, sometimes


def _keys_set_on_summary(node: ast.AST) -> list[str]:
    def is_summary(n: ast.AST | None) -> bool:
        return isinstance(n, ast.Name) and n.id == "summary"

    keys: list[ast.expr | None] = []
    if isinstance(node, ast.Assign) and is_summary(node.targets[0]) and isinstance(node.value, ast.Dict):
        keys = node.value.keys
    elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and is_summary(node.value):
        keys = [node.slice]
    elif isinstance(node, ast.Dict):  # {**summary, KEY: ...}: a None key is a ** unpacking
        pairs = zip(node.keys, node.values, strict=True)
        keys = node.keys if any(k is None and is_summary(v) for k, v in pairs) else []
    return [k.value for k in keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]


def _summary_lines(text: str) -> list[dict]:
    """The JSON objects shown in ``text``, one a line, that have a key of the summary (not a data row's)."""
    always, sometimes = summary_keys()
    shown = []
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and set(obj) & (always | sometimes):
            shown.append(obj)
    return shown


def _allocation(override: str) -> str:
    """The allocation ``override`` composes to, resolved and written as a shorthand."""
    return format_spec(_composed_allocation(override).roles())


def _allocation_field(preset: str, field: str) -> int:
    role, name = field.split(".")
    return getattr(getattr(_composed_allocation(f"allocation={preset}"), role), name)


@functools.cache
def _composed_allocation(override: str) -> AllocationConfig:
    """The allocation ``override`` composes to, resolved (on cluster=local_gpu, whose 8-GPU nodes hold every
    preset)."""
    return load("cluster=local_gpu", override).allocation


def _counts_said(sentence: str) -> dict[str, int]:
    words = _NUMBER.strip("()").split("|")[1:]
    said = {}
    for field, pattern in _COUNTS.items():
        for number in pattern.findall(sentence)[:1]:
            said[field] = int(number) if number.isdigit() else words.index(number.lower()) + 1
    return said


def _sentences(text: str) -> list[str]:
    """``text``'s sentences and clauses (split at '.' and ';'), each table row one."""
    found = []
    for paragraph in text.split("\n\n"):
        if paragraph.lstrip().startswith("|"):
            found += paragraph.splitlines()
        else:
            found += re.split(r"(?<=[.;])\s+", " ".join(paragraph.split()))
    return found


def _comments(path: Path) -> str:
    return "\n".join(line.partition("#")[2] for line in path.read_text().splitlines() if "#" in line)


def _a_users_directory(where: str) -> bool:
    """A config directory the docs may give: a placeholder, or a directory in the user's home or at an absolute
    path, outside the package (never one relative to where the user stands: in a checkout that is the package's)."""
    if where.isupper():
        return True
    if not where.startswith(("~", "/")):
        return False
    return not Path(where).expanduser().resolve().is_relative_to(CONF_DIR.resolve())


def _shell(command: str, home: Path) -> subprocess.CompletedProcess:
    """``command`` as a user types it, in a checkout: bash, with ``home`` as ~ and this interpreter as ``python``."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "HOME": str(home), "PATH": path, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


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
