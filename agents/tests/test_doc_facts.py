"""The facts the user docs state, checked against the code they describe.

The docs (README.md, docs/*.md) name limits with their values, classes with their fields, CLI
commands with their flags, modules and loggers, and quote error texts. After many commits a value
or a name changes in the code and the sentence about it does not; these tests read the docs' inline
code spans mechanically and check each fact that can be checked without judgement. Phrasings the
regexes misread are listed below, each with its reason, so a new drift fails loudly instead.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import importlib
import inspect
import math
import os
import pkgutil
import re
import shlex
import tomllib
import typing
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import click
import pytest

import dex_agents
import dex_engine
from dex_agents import AgentToolCall, AgentToolCallStatus, BuiltInTool, CompactionPolicy, ToolEffect
from dex_agents._policy import build_turn_failure_note
from dex_agents.builtin_loop import (
    AgentDefinition,
    ScriptedModelClient,
    ScriptedModelReply,
    builtin_agent_session_flow,
)
from dex_agents.cli import main as agents_cli
from dex_engine.cli import cli as engine_cli

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = [*sorted((REPO_ROOT / "docs").glob("*.md")), REPO_ROOT / "README.md", REPO_ROOT / "engine" / "README.md"]
SOURCE_ROOTS = [REPO_ROOT / "engine" / "src", REPO_ROOT / "agents" / "src"]


def _prose(path: Path) -> str:
    """The doc's text without fenced code blocks (run by test_doc_samples), whitespace folded."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return re.sub(r"\s+", " ", text)


def _spans() -> Iterator[tuple[str, str]]:
    """(doc name, text) of every inline code span of the docs but the seed's column of
    deviations.md (the seed's names, which this code departs from)."""
    for path in DOCS:
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
        if path.name == "deviations.md":
            text = "\n".join(line.split(" | ", 1)[-1] if line.startswith("| ") else line for line in text.splitlines())
        # A span may wrap onto the next line, but never crosses a blank line or a table row.
        for match in re.finditer(r"`([^`\n]+(?:\n(?![\n|])[^`\n]*)*)`", text):
            yield path.name, " ".join(match.group(1).split())


# Importing LiteLLM takes seconds (and, unless told not to, the network): its module's names are
# read from its source instead.
_LITELLM_MODULE = "dex_agents.litellm"
_LITELLM_NAMES = {
    name for node in ast.parse((SOURCE_ROOTS[1] / "dex_agents" / "litellm.py").read_text(encoding="utf-8")).body
    for name in ([node.name] if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                 else [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign)
                 else [node.target.id] if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                 else [])
}


def _all_modules() -> list[ModuleType]:
    """Every module of both packages, so a fact about an internal name is checked too."""
    modules: list[ModuleType] = []
    for package in (dex_engine, dex_agents):
        modules.append(package)
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.endswith("__main__") or info.name == _LITELLM_MODULE:
                continue
            try:
                modules.append(importlib.import_module(info.name))
            except ImportError:  # an optional extra (psycopg, litellm) that is not installed
                continue
    return modules


MODULES = _all_modules()
# The limits' own modules first: a constant re-exported elsewhere has the same value.
_LIMIT_MODULES = [importlib.import_module("dex_engine._limits"), importlib.import_module("dex_agents._constants")]


def _constant(name: str) -> object:
    for module in _LIMIT_MODULES + MODULES:
        if name in vars(module):
            return vars(module)[name]
    raise KeyError(name)


def _defined_anywhere(name: str) -> bool:
    try:
        _constant(name)
    except KeyError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Constants and the values stated beside them

_UNIT_SECONDS = {
    "ms": 0.001, "s": 1.0, "second": 1.0, "seconds": 1.0, "minute": 60.0, "minutes": 60.0,
    "hour": 3600.0, "hours": 3600.0, "day": 86400.0, "days": 86400.0,
    # The limits count a year as 366 days, so that a leap year's dates fit.
    "year": 366 * 86400.0, "years": 366 * 86400.0,
}
_UNIT_BYTES = {"bytes": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
_WORDS = {"a": 1.0, "an": 1.0, "one": 1.0, "ten": 10.0}
_NUMBER = r"(?:\d[\d,]*(?:\.\d+)?|an?|one|ten)\b"
_UNIT = "|".join(sorted([*_UNIT_SECONDS, *_UNIT_BYTES], key=len, reverse=True))
_VALUE = rf"(?P<number>{_NUMBER})(?:\s*(?P<unit>{_UNIT})\b)?"
# `NAME` (value ...), `NAME`, value ...  or  `NAME` = value
_AFTER = re.compile(rf"`(?P<name>[A-Z][A-Z0-9_]{{3,}})`(?: \(|, | = ){_VALUE}")
# (value unit? up to four words (`NAME`  or  value, `NAME`
_BEFORE = re.compile(rf"(?<![\w.]){_VALUE}(?:(?: [a-z][\w']*){{0,4}} \(|, )`(?P<name>[A-Z][A-Z0-9_]{{3,}})`")

# (doc, name, the doc's words for the value) the regexes misread, each with why it is left out
# (none so far: add one here rather than loosening the regexes).
_MISREAD: dict[tuple[str, str, str], str] = {}


def _doc_value(name: str, number: str, unit: str | None) -> float | None:
    """The stated value in the constant's own unit (its name's suffix); None when the words are
    no value ("a" alone), NaN when their unit cannot be the constant's (a duration stated for a
    count), which then equals no value of the code."""
    if number in _WORDS:
        if unit is None:  # "a" or "one" alone is English, not a value
            return None
        amount = _WORDS[number]
    else:
        amount = float(number.replace(",", ""))
    if name.endswith(("_SECONDS", "_MS")):
        seconds = amount * _UNIT_SECONDS.get(unit or "s", math.nan)
        return seconds * 1000 if name.endswith("_MS") else seconds
    if name.endswith("_BYTES"):
        return amount * _UNIT_BYTES.get(unit or "bytes", math.nan)
    return amount if unit is None else math.nan


def _stated_values() -> list[tuple[str, str, str, float]]:
    """(doc, name, the doc's words, value in the constant's unit) of every constant whose value
    the docs state beside its name."""
    found: list[tuple[str, str, str, float]] = []
    for path in DOCS:
        prose = _prose(path)
        for pattern in (_AFTER, _BEFORE):
            for match in pattern.finditer(prose):
                name, number, unit = match["name"], match["number"], match["unit"]
                if not _defined_anywhere(name) or not isinstance(_constant(name), (int, float, tuple)):
                    continue
                if isinstance(_constant(name), bool):
                    continue
                value = _doc_value(name, number, unit)
                if value is None:
                    continue
                found.append((path.name, name, match.group(0), value))
    return found


def test_every_constant_value_the_docs_state_is_the_codes() -> None:
    """Catches: a limit changed in _limits.py or _constants.py while the docs still give the old
    value (or the unit is wrong: seconds stated for a constant in milliseconds)."""
    stated = _stated_values()
    # The docs state dozens of such values; far fewer means the regexes stopped reading them.
    assert len(stated) >= 30, stated
    wrong: list[str] = []
    for doc, name, words, value in stated:
        if (doc, name, words) in _MISREAD:
            continue
        code = _constant(name)
        if isinstance(code, tuple):
            code = code[0]  # a tuple's doc lists its values in order; its first is stated first
        assert isinstance(code, (int, float))
        if not math.isclose(value, float(code), rel_tol=1e-9, abs_tol=1e-12):
            wrong.append(f"{doc}: {words!r} states {value:g} but {name} = {code!r}")
    assert not wrong, "\n".join(wrong)


def test_the_doc_value_reader_reads_the_phrasings_the_docs_use() -> None:
    """The reader's own examples, so a change to the regexes cannot quietly read nothing."""
    prose = ("at most `MAX_VALUE_BYTES` (1 MiB encoded), every 2 s (`X_SECONDS`), once an hour "
             "(`Y_MS`) and (`Z_SECONDS`, 20 ms: a client's) and `COUNT` = 4,096")
    after = [(m["name"], _doc_value(m["name"], m["number"], m["unit"])) for m in _AFTER.finditer(prose)]
    before = [(m["name"], _doc_value(m["name"], m["number"], m["unit"])) for m in _BEFORE.finditer(prose)]
    assert after == [("MAX_VALUE_BYTES", 1024.0**2), ("Z_SECONDS", 0.02), ("COUNT", 4096.0)]
    assert before == [("X_SECONDS", 2.0), ("Y_MS", 3_600_000.0)]


# Backticked UPPER_CASE words in the docs that are not constants of this code, each with why.
# A model provider's credential variable, which LiteLLM reads (OPENAI_API_KEY, ANTHROPIC_AUTH_TOKEN, ...):
# the docs name them as examples; the code matches them by pattern, not by name.
_PROVIDER_VARIABLE = re.compile(r"[A-Z0-9_]+_(?:API_KEY|AUTH_TOKEN|ACCESS_KEY)")

_NOT_CONSTANTS: dict[str, str] = {
    "TEST_PG_DSN": "an environment variable the tests read",
    "DEX_PG_FRESH_DB": "an environment variable the tests read",
    "DEX_ENGINE_DB": "an environment variable the CLI reads (checked by the CLI test below)",
    "DEX_AGENTS_TEST_DATABASE_URL": "an environment variable (the value of ENV_DATABASE_URL)",
    "PGCLIENTENCODING": "libpq's environment variable, which the PostgreSQL store overrides",
    "DEXCLI": "seed 003's environment variable, named in deviations.md as not used",
    "CREATE": "SQL",
    "DROP": "SQL",
    "VACUUM": "SQL",
    "FAST": "a name in the tests' conftest.py",
    "MOST_TEST_PROCESSES": "a name in the repository's root conftest.py (engine/tests/test_suite_hooks.py)",
    "SQLITE_BUSY": "an SQLite result code",
    "SQLITE_READONLY": "an SQLite result code",
    "NOT_STARTED": "an AttemptProgress value, spelled as the wire spells it",
    "NOT_COMPLETED": "an AttemptProgress value, spelled as the wire spells it",
    "KEY": "a part of an environment variable's name the redaction looks for",
    "TOKEN": "a part of an environment variable's name the redaction looks for",
    "SECRET": "a part of an environment variable's name the redaction looks for",
    "PASSWORD": "a part of an environment variable's name the redaction looks for",
    "CREDENTIAL": "a part of an environment variable's name the redaction looks for",
    "FULL": "an SQLite synchronous level",
    "OPENAI_BASE_URL": "LiteLLM's environment variable for an openai/ model's server (its 404 hint names it)",
    "NORMAL": "an SQLite synchronous level",
    "WAL": "an SQLite journal mode",
    "AND": "a word of the search query language",
}


def _not_implemented_names() -> set[str]:
    """Names deviations.md lists in rows that say the seed's feature is not implemented: they
    must stay absent (checked below), so they are not expected to exist."""
    names: set[str] = set()
    for row in (REPO_ROOT / "docs" / "deviations.md").read_text(encoding="utf-8").splitlines():
        cells = row.split(" | ")
        if len(cells) >= 2 and cells[1].startswith("not implemented"):
            names.update(re.findall(r"`([^`]+)`", cells[0]))
    return names


def test_every_upper_case_name_in_the_docs_is_a_constant_of_the_code() -> None:
    """Catches: a constant renamed or removed while the docs still send readers to it."""
    missing: set[str] = set()
    excused = set(_NOT_CONSTANTS) | _not_implemented_names()
    for doc, span in _spans():
        if not re.fullmatch(r"[A-Z][A-Z0-9_]{2,}", span) or span in excused or _PROVIDER_VARIABLE.fullmatch(span):
            continue
        if not _defined_anywhere(span):
            missing.add(f"{doc}: {span}")
    assert not missing, sorted(missing)


def test_what_deviations_md_calls_not_implemented_is_absent() -> None:
    """Catches: a seed feature implemented after all while deviations.md still says it is not
    (so users are told to do without it)."""
    present: list[str] = []
    for name in sorted(_not_implemented_names()):
        bare = name.split(".")[-1].removesuffix("()")
        # Python names only: CamelCase or snake_case with an underscore (not `chat`, a span name)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", bare) or not re.search(r"[A-Z_]", bare):
            continue
        if name.startswith("dex_agents."):
            try:
                importlib.import_module(name)
            except ImportError:
                continue
            present.append(name)
        elif any(bare in vars(module) for module in MODULES):
            present.append(name)
    assert not present, present


# ---------------------------------------------------------------------------------------------
# Classes, fields, methods and modules


def _classes(name: str) -> list[object]:
    """Every class of that name (each store has its own `Db`)."""
    found: list[object] = []
    for module in MODULES:
        obj = vars(module).get(name)
        if obj is not None and hasattr(obj, "__dict__") and all(obj is not other for other in found):
            found.append(obj)
    return found


def _has(obj: object, attribute: str) -> bool:
    if hasattr(obj, attribute):
        return True
    if dataclasses.is_dataclass(obj) and attribute in {f.name for f in dataclasses.fields(obj)}:
        return True
    try:
        return attribute in typing.get_type_hints(obj)
    except Exception:  # a forward reference only a type checker resolves
        return attribute in getattr(obj, "__annotations__", {})


# `Class.attribute` spans whose class does not define the attribute, each with why it is right.
_ATTRIBUTES_ELSEWHERE: dict[str, str] = {
    "Db.unstored": "an attribute the Db protocol leaves optional (its comment); SQLite's _SqliteDb has it",
}


def test_every_class_attribute_the_docs_name_exists() -> None:
    """`Class.field`, `Class.method(...)` and `Class(keyword=...)` of the docs. Catches: a field,
    method or keyword renamed while the docs still use the old name."""
    excused = _not_implemented_names()
    wrong: list[str] = []
    checked = 0
    for doc, span in _spans():
        if span in excused:
            continue
        for match in re.finditer(r"\b([A-Z][A-Za-z0-9]+)\.([a-z_][A-Za-z0-9_]*)\b", span):
            classes = _classes(match.group(1))
            if not classes or match.group(0) in _ATTRIBUTES_ELSEWHERE:
                continue
            checked += 1
            if not any(_has(cls, match.group(2)) for cls in classes):
                wrong.append(f"{doc}: `{span}`: {match.group(1)} has no {match.group(2)}")
        for match in re.finditer(r"\b([A-Z][A-Za-z0-9]+)\(([^()]*)\)", span):
            classes = _classes(match.group(1))
            if len(classes) != 1 or not callable(cls := classes[0]):
                continue
            try:
                parameters = inspect.signature(cls).parameters
            except (TypeError, ValueError):
                continue
            for keyword in re.findall(r"\b([a-z_][a-z0-9_]*)=", match.group(2)):
                checked += 1
                if keyword not in parameters:
                    wrong.append(f"{doc}: `{span}`: {match.group(1)} takes no {keyword}=")
    assert checked >= 40, checked
    assert not wrong, "\n".join(wrong)


def test_every_keyword_the_docs_pass_to_a_function_exists() -> None:
    """`function(keyword=...)` and `client.method(keyword=...)` spans. Catches: a keyword
    renamed while the docs still pass the old one (a TypeError for whoever copies it)."""
    functions: dict[str, list[object]] = {}
    for module in MODULES:
        for name, obj in vars(module).items():
            if callable(obj) and not name.startswith("_"):
                functions.setdefault(name, []).append(obj)
            if isinstance(obj, type):
                for member, method in vars(obj).items():
                    if callable(method) and not member.startswith("_"):
                        functions.setdefault(member, []).append(method)
    checked = 0
    wrong: list[str] = []
    for doc, span in _spans():
        for match in re.finditer(r"\b([a-z_][a-z0-9_]*)\(([^()]*)\)", span):
            keywords = re.findall(r"\b([a-z_][a-z0-9_]*)=", match.group(2))
            if not keywords or match.group(1) not in functions:
                continue
            checked += 1
            signatures = []
            for function in functions[match.group(1)]:
                try:
                    signatures.append(inspect.signature(function).parameters)  # type: ignore[arg-type]
                except (TypeError, ValueError):
                    continue
            if not any(all(k in parameters for k in keywords)
                       or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
                       for parameters in signatures):
                wrong.append(f"{doc}: `{span}`: no {match.group(1)} takes {keywords}")
    assert checked >= 8, checked
    assert not wrong, "\n".join(wrong)


def _logger_names() -> set[str]:
    names: set[str] = set()
    for root in SOURCE_ROOTS:
        for path in root.rglob("*.py"):
            names.update(re.findall(r"getLogger\(\"([\w.]+)\"\)", path.read_text(encoding="utf-8")))
    return names


def test_every_module_and_logger_the_docs_name_exists() -> None:
    """`dex_engine.x.y` and `dex_agents.x.y` spans: a module, a name in one, or a logger's name.
    Catches: a module or logger renamed while the docs still point at it (a logging config that
    names the old logger silently matches nothing)."""
    excused = _not_implemented_names()
    loggers = _logger_names()
    wrong: list[str] = []
    for doc, span in _spans():
        if not re.fullmatch(r"dex_(engine|agents)(\.[A-Za-z_][A-Za-z0-9_]*)+", span) or span in excused:
            continue
        if span in loggers:
            continue
        if span.startswith(_LITELLM_MODULE):
            if span != _LITELLM_MODULE and span.split(".")[2] not in _LITELLM_NAMES:
                wrong.append(f"{doc}: {span}")
            continue
        parts = span.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj: object = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            found = True
            target: object = obj
            for part in parts[cut:]:
                if not hasattr(target, part):
                    found = False
                    break
                target = getattr(target, part)
            if not found:
                wrong.append(f"{doc}: {span}")
            break
        else:
            wrong.append(f"{doc}: {span}")
    assert not wrong, wrong


def test_every_file_the_docs_name_exists() -> None:
    """`name.py` spans (tests, benchmarks, modules). Catches: a test file or benchmark renamed or
    merged while the docs still send readers to it."""
    files = {path.name for path in REPO_ROOT.rglob("*.py") if ".venv" not in path.parts}
    wrong = sorted({f"{doc}: {span}" for doc, span in _spans()
                    if re.fullmatch(r"[\w/]+\.py( .*)?", span) and span.split()[0].split("/")[-1] not in files})
    assert not wrong, wrong


# CamelCase spans that are neither this code's names nor its strings, each with where it is from.
_OTHER_NAMES: dict[str, str] = {
    "Enum": "Python's enum", "InitVar": "Python's dataclasses", "TypedDict": "Python's typing",
    "TaskGroup": "Python's asyncio", "CancelledError": "Python's asyncio",
    "Authorization": "an HTTP header", "ProgramLimitExceeded": "a psycopg error class",
    "DirectTurns": "a class of bench/agent_turn.py", "PgProxy": "a class of the engine's tests",
    "PostgresDsn": "a pydantic URL type",
}


def test_every_camel_case_name_the_docs_use_is_the_codes() -> None:
    """`Name` spans: a class or function of the code, or a Step type, attribute, event or error
    type, which the code spells as a string. Catches: a Step or attribute renamed while the docs
    (and users' search queries such as `ActiveStepTypes = "AwaitToolApproval"`) use the old name."""
    names = {name for module in MODULES for name in vars(module)} | _LITELLM_NAMES
    strings = set(_source_strings())
    excused = set(_OTHER_NAMES) | _not_implemented_names()
    wrong = sorted({f"{doc}: {span}" for doc, span in _spans()
                    if re.fullmatch(r"[A-Z][a-z]+[A-Za-z0-9]*", span) and span not in names | strings | excused
                    and not hasattr(builtins, span)})
    assert not wrong, wrong


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _sections(path: Path) -> list[str]:
    """A doc's headings and its bold lead-ins (`- **Locks.** ...`), which the docs cite by name."""
    text = path.read_text(encoding="utf-8")
    return ([line.lstrip("#").strip() for line in text.splitlines() if re.match(r"#+ ", line)]
            + [bold.rstrip(".") for bold in re.findall(r"^- \*\*([^*]+)\*\*", text, re.M)])


def test_every_link_and_section_the_docs_point_to_exists() -> None:
    """`[text](other.md#anchor)` links, and citations such as (docs/engine.md, "Durability modes")
    or (see "Plans and plan mode"). Catches: a section renamed or merged while other pages still
    send readers to it."""
    sections = {path.name: _sections(path) for path in DOCS}
    wrong: list[str] = []
    for path in DOCS:
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if link.startswith(("http://", "https://")):
                continue
            target, _, anchor = link.partition("#")
            file = (path.parent / target) if target else path
            if not file.exists():
                wrong.append(f"{path.name}: link to a missing file: {link}")
            elif anchor and file.name in sections and anchor not in {_anchor(h) for h in sections[file.name]}:
                wrong.append(f"{path.name}: link to a missing section: {link}")
        prose = " ".join(text.split())
        for doc, title in re.findall(r'docs/(\w+)\.md, "([^"]+)"', prose):
            if not any(heading.startswith(title) for heading in sections.get(f"{doc}.md", [])):
                wrong.append(f'{path.name}: docs/{doc}.md has no section "{title}"')
        for title in re.findall(r'\b[Ss]ee "([^"]+)"', prose):
            if not any(title == heading for headings in sections.values() for heading in headings):
                wrong.append(f'{path.name}: no doc has a section "{title}"')
    assert not wrong, "\n".join(wrong)


def test_every_test_the_docs_name_exists() -> None:
    """`test_name` spans (and `path.py::test_name`), which the docs cite as evidence. Catches: a
    test renamed or deleted while the docs still point at it."""
    defined = {name for path in REPO_ROOT.rglob("test_*.py") if ".venv" not in path.parts
               for name in re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(encoding="utf-8"), re.M)}
    named = {(doc, match) for doc, span in _spans() for match in re.findall(r"(?:^|::)(test_\w+)$", span)
             if not match.endswith("_py")}
    assert len(named) >= 10, named
    wrong = sorted(f"{doc}: {name}" for doc, name in named if name not in defined)
    assert not wrong, wrong


# ---------------------------------------------------------------------------------------------
# The CLIs


def _cli_options(group: click.Group) -> dict[str, set[str]]:
    return {name: {opt for param in command.params for opt in [*param.opts, *param.secondary_opts]}
            for name, command in group.commands.items()}


def _commands() -> Iterator[tuple[str, str]]:
    """(doc name, command) of every shell command the docs give a reader to type: each line of
    their bash blocks (each `&&` part on its own, comments dropped), then every inline span."""
    for path in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S):
            for line in block.splitlines():
                code = "" if line.lstrip().startswith("#") else line.split(" #")[0]
                for part in code.split("&&"):
                    if part.strip():
                        yield path.name, " ".join(part.split())
    yield from _spans()


BENCH = REPO_ROOT / "bench"
# uv's options that take a value (`uv run --group bench python ...`).
_UV_VALUE_OPTIONS = {"--group", "--project", "--python", "--with"}


def _command_words(command: str) -> list[str]:
    """The words of a command as the program it runs sees them: leading VAR=value assignments, and
    `uv run` or `python` with their own options, dropped."""
    words = command.split()
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]
    if words[:2] == ["uv", "run"]:
        words = words[2:]
        while words and words[0].startswith("--"):
            words = words[2:] if words[0] in _UV_VALUE_OPTIONS else words[1:]
    if words[:1] == ["python"]:
        words = words[1:]
    return words


def test_every_cli_command_and_flag_the_docs_name_exists() -> None:
    """`dex-engine CMD --flag` and `dex-agents CMD` commands (inline or in a bash block, run bare or
    with `uv run`), each `--flag` of a benchmark command (`uv run python bench/x.py --flag`) in that
    script, and each `--flag` span alone in some script. Catches: a subcommand or flag renamed while
    the docs still tell users to type the old one."""
    assert isinstance(agents_cli, click.Group)
    clis = {"dex-engine": _cli_options(engine_cli), "dex-agents": _cli_options(agents_cli)}
    sources = "\n".join(path.read_text(encoding="utf-8") for path in REPO_ROOT.rglob("*.py")
                        if ".venv" not in path.parts)
    wrong: list[str] = []
    checked = 0
    for doc, command in _commands():
        words = _command_words(command)
        if words and words[0] in clis and len(words) > 1 and not words[1].startswith("-"):
            checked += 1
            options = clis[words[0]].get(words[1])
            if options is None:
                wrong.append(f"{doc}: `{command}`: no command {words[1]}")
                continue
            wrong += [f"{doc}: `{command}`: {words[1]} takes no {w}" for w in words[2:]
                      if w.startswith("--") and w not in options]
        elif words and re.fullmatch(r"(bench/)?\w+\.py", words[0]) and (BENCH / Path(words[0]).name).exists():
            checked += 1
            script = (BENCH / Path(words[0]).name).read_text(encoding="utf-8")
            wrong += [f"{doc}: `{command}`: no {w} in {words[0]}" for w in words[1:]
                      if w.startswith("--") and f'"{w}"' not in script]
        elif words and re.fullmatch(r"--[a-z][a-z-]+", words[0]) and words[0] != "--preload":  # gunicorn's
            wrong += [f"{doc}: `{command}`: no {w} in any script" for w in words
                      if w.startswith("--") and f'"{w}"' not in sources]
    assert checked >= 20, checked
    assert not wrong, "\n".join(wrong)


def test_the_step_shape_block_names_every_step_of_a_session() -> None:
    """docs/agents.md "Step shape": each CamelCase name is a Step of a session Flow (every built-in
    tool and compaction on) or a runner outcome type, and every Step of that Flow is in it.
    Catches: a Step added, renamed or removed while the shape readers debug from stays as it was."""
    text = (REPO_ROOT / "docs" / "agents.md").read_text(encoding="utf-8")
    (shape,) = re.findall(r"## Step shape\n\n```text\n(.*?)```", text, flags=re.S)
    model = ScriptedModelClient(lambda request: ScriptedModelReply(text="ok"))
    agent = AgentDefinition(name="shape", instructions="x", model=model, built_in_tools=frozenset(BuiltInTool),
                            plan_mode_enabled=True, compaction=CompactionPolicy(context_window_tokens=100_000))
    steps = set(builtin_agent_session_flow(agent).steps)
    named = set(re.findall(r"\b[A-Z][a-z]+(?:[A-Z][a-z]+)+\b", shape))
    outcomes = {name for name in named if isinstance(getattr(dex_agents, name, None), type)}
    assert {"TurnCompleted", "ToolCallsRequested", "ToolTaskStarted"} <= outcomes, outcomes
    assert sorted(named - steps - outcomes) == [], "named in the Step shape but no Step or outcome type"
    assert sorted(steps - named) == [], "Steps of a session missing from the Step shape"


def test_the_turn_failure_note_block_is_the_note_the_session_stores() -> None:
    """docs/agents.md's text block of the note a failed turn stores, built from one call record
    (its `...` stands for the rest of the line). Catches: the note's header, line or footer
    reworded while the doc still shows the old words, which users grep transcripts for."""
    text = (REPO_ROOT / "docs" / "agents.md").read_text(encoding="utf-8")
    (shown,) = [block for block in re.findall(r"```text\n(.*?)```", text, flags=re.S)
                if block.startswith("[Dex] The previous turn failed")]
    record = AgentToolCall(
        tool_call_id="call_0", turn_id="turn-1", tool_name="refund_order", arguments='{"order_id": "A-1001"}',
        effect=ToolEffect.NON_IDEMPOTENT_WRITE, requires_approval=True, status=AgentToolCallStatus.OUTCOME_UNKNOWN,
        output=None, error=None, rejection_message=None, deferral_order=0, tool_source_reference=None,
        trace_context=None)
    note = build_turn_failure_note([record])
    assert note is not None
    pattern = ".*".join(re.escape(piece) for piece in shown.strip().split("..."))
    assert re.fullmatch(pattern, note, flags=re.S), (shown, note)


def test_the_newest_migration_the_docs_name_is_the_newest() -> None:
    """deployment.md: "The newest one (schema 8 on SQLite, 7 on PostgreSQL) builds ...". Catches: a
    migration added while the rolling-upgrade advice still describes the one before it."""
    migrations = REPO_ROOT / "engine" / "src" / "dex_engine" / "_migrations"
    newest = {backend: max(int(path.name[:4]) for path in (migrations / backend).glob("[0-9]*.sql"))
              for backend in ("sqlite", "postgres")}
    stated = [(int(sqlite), int(postgres)) for path in DOCS
              for sqlite, postgres in re.findall(r"[Tt]he newest one \(schema (\d+) on SQLite, (\d+) on PostgreSQL\)",
                                                 _prose(path))]
    assert stated, "the phrase is gone: update this test with the docs"
    assert set(stated) == {(newest["sqlite"], newest["postgres"])}, (stated, newest)


def _pyproject(path: Path) -> dict[str, Any]:
    with path.open("rb") as file:
        return tomllib.load(file)


def test_every_path_extra_group_and_marker_the_docs_commands_use_exists() -> None:
    """The docs' commands: `.ci/` scripts (executable), `pip install ./engine './agents[litellm]'`
    (a package directory and its extra), `uv ... --group G` (a dependency group), and `pytest`'s
    test paths and `-m` markers. Catches: a script, extra, group, test file or marker renamed while
    the install, test and CI commands of the docs still use the old name."""
    root = _pyproject(REPO_ROOT / "pyproject.toml")
    groups = set(root["dependency-groups"])
    markers = {line.split(":")[0].strip() for line in root["tool"]["pytest"]["ini_options"]["markers"]}
    wrong: list[str] = []
    checked = 0
    # A package with an extra (`'./agents[litellm]'`) wherever a doc names one, in a comment too.
    extras = [(path.name, "pip install " + " ".join(re.findall(r"\./\w+\[\w+\]", path.read_text(encoding="utf-8"))))
              for path in DOCS]
    for doc, command in [*_commands(), *extras]:
        try:
            words = shlex.split(command.replace("$(", " "))
        except ValueError:  # a line of a command that goes on over several lines, its quote open
            words = command.split()
        for script in re.findall(r"(?<![\w/])\.ci/[\w-]+", command):
            checked += 1
            if not os.access(REPO_ROOT / script, os.X_OK):
                wrong.append(f"{doc}: `{command}`: no executable {script}")
        for i, word in enumerate(words):
            if word == "--group" and i + 1 < len(words):
                checked += 1
                if words[i + 1] not in groups:
                    wrong.append(f"{doc}: `{command}`: no dependency group {words[i + 1]}")
        if words[:2] == ["pip", "install"]:
            for package in words[2:]:
                match = re.fullmatch(r"\./(\w+)(?:\[(\w+)\])?", package)
                if match is None:
                    continue
                checked += 1
                pyproject = REPO_ROOT / match.group(1) / "pyproject.toml"
                if not pyproject.exists():
                    wrong.append(f"{doc}: `{command}`: no package directory {match.group(1)}")
                elif match.group(2) and match.group(2) not in _pyproject(pyproject)["project"].get(
                        "optional-dependencies", {}):
                    wrong.append(f"{doc}: `{command}`: {match.group(1)} has no extra {match.group(2)}")
        if "pytest" in words:
            for i, word in enumerate(words[words.index("pytest") + 1:], words.index("pytest") + 1):
                if re.fullmatch(r"[\w/]+\.py(::\w+)?", word):
                    checked += 1
                    if not (REPO_ROOT / word.split("::")[0]).exists():
                        wrong.append(f"{doc}: `{command}`: no test file {word}")
                elif words[i - 1] == "-m":
                    checked += 1
                    names = set(re.findall(r"\w+", word)) - {"not", "and", "or"}
                    wrong += [f"{doc}: `{command}`: no marker {name}" for name in names - markers]
    assert checked >= 8, checked
    assert not wrong, "\n".join(wrong)


def test_the_litellm_pin_the_docs_give_is_the_extras() -> None:
    """deviations.md gives the litellm extra's pin (releases after the compromised ones)."""
    pyproject = (REPO_ROOT / "agents" / "pyproject.toml").read_text(encoding="utf-8")
    pin = re.search(r'^litellm = \["([^"]+)"\]', pyproject, re.M)
    assert pin is not None
    stated = {span for _, span in _spans() if re.fullmatch(r"litellm[<>=!]=?[\d.].*", span)}
    assert stated == {pin.group(1)}, (stated, pin.group(1))


def test_the_cli_reads_the_environment_variable_the_docs_name() -> None:
    """engine.md: each command takes `--db URL` (or `DEX_ENGINE_DB`)."""
    for name, command in engine_cli.commands.items():
        db = [param for param in command.params if "--db" in getattr(param, "opts", [])]
        assert db, f"dex-engine {name} takes no --db"
        assert name == "demo" or db[0].envvar == "DEX_ENGINE_DB", name


def test_the_worker_options_tables_give_the_defaults_of_the_code() -> None:
    """The `WorkerOptions` tables of engine.md and deployment.md. Catches: a default changed while
    the table still gives the old one."""
    defaults = {f.name: f.default for f in dataclasses.fields(dex_engine.WorkerOptions)}
    rows = 0
    for path in DOCS:
        table = False
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith("| setting (`WorkerOptions`)"):
                table = True
                continue
            if table and not line.startswith("|"):
                table = False
            match = re.match(r"\| `(\w+)` \| ([^|]+) \|", line) if table else None
            if match:
                rows += 1
                name, stated = match.group(1), match.group(2).strip()
                assert name in defaults, f"{path.name}: WorkerOptions has no {name}"
                code: object = defaults[name]
                assert (stated == "None" and code is None) or (
                    isinstance(code, (int, float)) and float(stated) == float(code)), (
                    f"{path.name}: {name} default {stated} but the code's is {code!r}")
    assert rows >= 10, rows


# ---------------------------------------------------------------------------------------------
# Quoted error texts


@functools.cache
def _source_strings() -> tuple[str, ...]:
    """Every string of the source but docstrings, with format fields as \\0."""
    strings: list[str] = []
    for root in SOURCE_ROOTS:
        for path in root.rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            docstrings = {id(node.value) for node in ast.walk(tree)
                          if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
            for node in ast.walk(tree):
                if id(node) in docstrings:
                    continue
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    strings.append(re.sub(r"%[sdr]|\{[^{}]*\}", "\0", node.value))
                elif isinstance(node, ast.JoinedStr):
                    strings.append("".join(v.value if isinstance(v, ast.Constant) and isinstance(v.value, str)
                                           else "\0" for v in node.values))
    return tuple(strings)


# Quoted texts built from several strings of the source, which the check cannot join, each
# checked by hand: the parts the source builds them from.
_COMPOSED_TEXTS: dict[str, tuple[str, ...]] = {
    # _turn_steps.py: f"its {what} does not fit with the turn's other pending interrupts (...)"
    "its question does not fit with the turn's other pending interrupts ...":
        ("its ", " does not fit with the turn's other pending interrupts"),
    # TOOL_CALL_NOT_RUN_ERROR_PREFIX, then _policy.py's f"tool {name} changed after the model called it: "
    "the tool did not run, so it is safe to call again: tool <name> changed after the model called it: ...":
        ("the tool did not run, so it is safe to call again", " changed after the model called it: "),
    # _turn_logic.py: f"{TOOL_CALL_NOT_RUN_ERROR_PREFIX}: {detail}", quoted up to the detail
    "the tool did not run, so it is safe to call again:": ("the tool did not run, so it is safe to call again",),
    # CANCELLED_WHILE_WAITING_TO_RETRY, then _transitions.py's end_retry_waits f"; its last attempt failed: ..."
    "cancelled while waiting to retry: the user cancelled the turn; its last attempt failed:":
        ("cancelled while waiting to retry: the user cancelled the turn", "; its last attempt failed: "),
    "cancelled while waiting to retry: the user cancelled the turn; its last attempt failed: <error>":
        ("cancelled while waiting to retry: the user cancelled the turn", "; its last attempt failed: "),
    # _transitions.py: f"{method}: {error.error_type}: {error.detail}", every part a field
    "execute: TypeError: ...": (),
    # _migrate.py: f"...: the database's schema is version {version}, newer than the {latest} this "
    "the database's schema is version N, newer than the M this dex_engine knows":
        ("the database's schema is version ", ", newer than the ", " this "),
    # agents.md's example of _policy.py's text, its policies filled in (sync_stock, read, ...)
    "the tool did not run, so it is safe to call again: tool sync_stock changed after the model called it: "
    "the call was recorded as read with no approval, and this Worker's agent defines it as "
    "non_idempotent_write needing approval; call it again to run it under the new definition":
        ("the tool did not run, so it is safe to call again", " changed after the model called it: ",
         "; call it again to run it under the new definition"),
}


def _looks_like_a_message(span: str) -> bool:
    """Prose in backticks: lower-case words (or a [Dex] note), no code punctuation; a parenthesis
    only as prose has one (`... were trimmed (stream capacity)`), not a call's."""
    return (len(span.split()) >= 3
            and re.fullmatch(r"(\[Dex\] |The )?[a-z<][\w<>' ,:;.()\-]*[\w.>:)]", span) is not None
            and re.search(r"\w\(", span) is None
            and not span.startswith(("uv ", "pip ", "ip ", "nice ", "taskset ", "pg_ctl ", "apt-get ", "mv ", "cp ",
                                     "python ", "dexcli ", "run state", "lease_ttl", "processes ", "dex-",
                                     "from ", "profile_turn")))


def test_every_error_text_the_docs_quote_is_in_the_source() -> None:
    """Catches: an error or recorded text reworded in the code while the docs still quote the old
    words (users grep their logs for them)."""
    strings = _source_strings()
    literal = "\n".join(piece for text in strings for piece in text.split("\0"))
    templates = [re.compile("(?s)" + ".*".join(re.escape(piece) for piece in text.split("\0")))
                 for text in strings if "\0" in text and len(text.replace("\0", "").strip()) >= 12]
    quoted = sorted({span for _, span in _spans() if _looks_like_a_message(span)})
    assert len(quoted) >= 10, quoted
    wrong: list[str] = []
    for span in quoted:
        if span in _COMPOSED_TEXTS:
            continue
        generic = re.sub(r"<[^<>]+>|\.\.\.", "\0", span)
        pieces = [piece for piece in generic.split("\0") if piece.strip()]
        if all(piece in literal for piece in pieces):
            continue
        if any(template.fullmatch(span) or template.fullmatch(generic) for template in templates):
            continue
        wrong.append(span)
    assert not wrong, wrong


@pytest.mark.parametrize("text", sorted(_COMPOSED_TEXTS))
def test_composed_texts_still_have_their_parts(text: str) -> None:
    """The hand-checked texts above still have their parts in the source."""
    literal = "\n".join(piece for s in _source_strings() for piece in s.split("\0"))
    for part in _COMPOSED_TEXTS[text]:
        assert part in literal, part
