"""Docs that cannot drift: the tables the code defines (settings, CLI commands) are generated from it, and every file,
link, command and `OPENTINKER_*` variable a doc or docstring names exists; the README's lines stay readable. (The
server's routes: tests/test_server_docs.py.)"""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("flows", "tasks", "envs", "agents", "federated", "serving", "infra", "tests", "opentinker", "bench", "docs")
REFERENCE = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w.-]*/)*[A-Za-z_][\w-]*\.(?:py|md))(?![\w/])")
"""A file name as the docs write one: ``server/channel.py``, ``docs/deploy.md``, ``job_child.py``."""
ROOTED = re.compile(rf"(?<![\w./-])((?:opentinker/)?(?:{'|'.join(TOP)})/[\w./-]*\w)/?(?![\w/])")
"""Any path from a top folder: ``infra/k8s/prefect.yaml``, ``agents/multiagent/``, ``envs/ray_backend.RayActorPool``."""
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)|^\[[^\]]+\]:\s*([^#\s]+)")
"""A markdown link's target, inline or a reference's definition (outside code spans: ``CODE``)."""
CODE = re.compile(r"`[^`]*`")
COMMAND = re.compile(r"`opentinker ((?:[a-z][a-z-]*)(?: [a-z][a-z-]*)*)")
"""A command as the docs write one: `opentinker server keys create --tenant T`, `opentinker jobs list|status`."""
ELSEWHERE = {
    "ppo_atari.py": "CleanRL's",
    "ppo_continuous_action.py": "CleanRL's",
    "sac_continuous_action.py": "CleanRL's",
    "td3_continuous_action.py": "CleanRL's",
    "tinker/lib/api_future_impl.py": "the tinker SDK's",
    "my_pkg/tasks.py": "a user's package in an example",
    "opentinker/tiny-llama": "the test model's hub-style name",
}
"""Other projects' files (and a model's hub-style name) the docs name on purpose."""
README_WIDTH = 200


def _gen_tables():
    spec = importlib.util.spec_from_file_location("gen_tables", ROOT / "docs" / "gen_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_tables_match_the_code():
    gen_tables = _gen_tables()
    stale = gen_tables.stale()
    assert not stale, f"{stale} differ from the code: run `{gen_tables.COMMAND}` and commit the result"


def test_a_setting_or_command_left_out_is_caught(tmp_path, monkeypatch):
    gen_tables = _gen_tables()
    for name, (doc, _) in gen_tables.BLOCKS.items():
        text = (gen_tables.DOCS / doc).read_text()
        block = text[text.index(f"<!-- generated: {name} -->") :]
        row = next(line for line in block.splitlines() if line.startswith("| `"))
        (tmp_path / doc).write_text(text.replace(row + "\n", ""))
    monkeypatch.setattr(gen_tables, "DOCS", tmp_path)
    assert sorted(gen_tables.stale()) == sorted({f"docs/{doc}" for doc, _ in gen_tables.BLOCKS.values()})


def _named_command(words: list[str], commands: set[tuple[str, ...]]) -> bool:
    """``words`` start with a command (what follows is its arguments), or name a group of commands."""
    for end in range(1, len(words) + 1):
        prefix = tuple(words[:end])
        if prefix in commands:
            return True
        if not any(command[:end] == prefix for command in commands):
            return False
    return True


def test_every_command_the_docs_name_exists():
    commands = {tuple(name.split()) for name, _ in _gen_tables().commands(hidden=True)}
    unknown = [
        f"{doc.name}: opentinker {mention}"
        for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for mention in COMMAND.findall(doc.read_text())
        if not _named_command(mention.split(), commands)
    ]
    assert not unknown, f"commands the CLI does not have: {unknown}"
    assert not _named_command(["server", "start"], commands)


def _project_files() -> list[Path]:
    files = [path for path in ROOT.iterdir() if path.is_file()]
    for top in TOP:
        files += [path for path in (ROOT / top).rglob("*") if path.is_file() and "__pycache__" not in path.parts]
    return files


def _names(files: list[Path]) -> set[str]:
    """Every way the docs name a project file: its path from the root and each tail of it (``server/channel.py``),
    and its import path (``opentinker/agents/ppo.py`` for ``agents/ppo.py``)."""
    names = set()
    for path in files:
        parts = path.relative_to(ROOT).parts
        names |= {"/".join(parts[i:]) for i in range(len(parts))}
        names.add("/".join(("opentinker", *parts)))
    return names


def _prose(path: Path):
    """(line, text) of what a reader reads as prose: a markdown file whole; a module's docstrings and comments."""
    source = path.read_text()
    if path.suffix == ".md":
        yield from enumerate(source.splitlines(), 1)
        return
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            for statement in node.body:
                if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
                    if isinstance(statement.value.value, str):
                        yield statement.lineno, statement.value.value
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def _unknown(name: str, names: set[str]) -> bool:
    if "/" not in name and name.endswith(".md"):
        return False  # an artifact's (model_card.md); a doc is named with its folder
    return name not in ELSEWHERE and name not in names


def _missing_path(name: str) -> bool:
    """``name`` (from a top folder) is neither a file or folder nor ``module.attribute`` of a module there."""
    for path in {name, name.removeprefix("opentinker/")}:
        folder, _, last = path.rpartition("/")
        if (ROOT / path).exists() or (ROOT / folder / f"{last.split('.')[0]}.py").is_file():
            return False
    return name not in ELSEWHERE


def _unknowns(text: str, names: set[str]) -> list[str]:
    found = [n for n in REFERENCE.findall(text) if _unknown(n, names)]
    return found + [n for n in ROOTED.findall(text) if n not in found and _missing_path(n)]


def _stale(path: Path, names: set[str]) -> list[str]:
    """``path``'s prose naming files that are not there (as ``LINE: NAME``)."""
    text = path.read_text()
    if path.suffix == ".py" and not _unknowns(text, names):
        return []  # the common case, without parsing the module
    stale = []
    for line, prose in _prose(path):
        stale += [f"{line}: {n}" for n in _unknowns(prose, names)]
        if path.suffix == ".md":
            for target in (inline or defined for inline, defined in LINK.findall(CODE.sub("", prose))):
                if "://" not in target and not (path.parent / target).exists():
                    stale.append(f"{line}: link {target}")
    return stale


def test_every_file_the_docs_name_exists():
    files = _project_files()
    names = _names(files)
    scanned = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(f for f in files if f.suffix == ".py")]
    missing = [f"{path.relative_to(ROOT)}:{stale}" for path in scanned for stale in _stale(path, names)]
    assert not missing, "names of files that do not exist:\n" + "\n".join(missing)


def test_a_missing_file_is_caught(tmp_path):
    names = _names(_project_files())
    module = tmp_path / "module.py"
    module.write_text(
        '"""Reads ``server/channel.py`` and ``infra/k8s/``, not ``server/job_proxy.py`` or ``infra/gone.yaml``."""\n\n'
        'NAME = "gone.py"  # a string in code is not prose; this comment names agents/gone.py\n'
    )
    doc = tmp_path / "doc.md"
    doc.write_text("See docs/service.md and [the walk](missing.md); `[x](code)` is code.\n\n[ref]: gone.png\n")
    assert _stale(module, names) == ["1: server/job_proxy.py", "1: infra/gone.yaml", "3: agents/gone.py"]
    assert _stale(doc, names) == ["1: link missing.md", "3: link gone.png"]


def test_every_variable_the_docs_name_is_read():
    """A renamed setting leaves no `OPENTINKER_*` variable behind in the docs: each is a field of `Settings` or
    `ServeSettings`, or one the code names itself (a process hands it the next, such as `OPENTINKER_CHANNEL_FD`)."""
    from opentinker.infra.settings import Settings
    from opentinker.serving.config import ServeSettings

    variable = re.compile(r"OPENTINKER_[A-Z0-9_]*[A-Z0-9]\b")
    known = {f"OPENTINKER_{name}".upper() for name in Settings.model_fields}
    known |= {f"OPENTINKER_SERVE_{name}".upper() for name in ServeSettings.model_fields}
    for path in _project_files():
        if path.suffix == ".py":
            known |= set(variable.findall(path.read_text()))
    unknown = [
        f"{doc.relative_to(ROOT)}: {name}"
        for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for name in sorted(set(variable.findall(doc.read_text())) - known)
    ]
    assert not unknown, f"variables nothing reads: {unknown}"


def test_readme_lines_are_short():
    long = [
        f"README.md:{number}: {len(line)} characters"
        for number, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1)
        if len(line) > README_WIDTH
    ]
    assert not long, f"lines over {README_WIDTH} characters (details belong in docs/):\n" + "\n".join(long)
