"""The runner contract's typing (seed 002 "Adapter interface"): a bare AgentFrameworkRunner returns
ToolExecutionResult, and AgentFrameworkRunner[DeferredToolOutcome] is a runner whose tools ask or
start tasks; the names seed 003 gives a turn's policy lookup and the flow's event Stream. Checked by
running mypy --strict (the project's settings) on code that uses them."""

from __future__ import annotations

from pathlib import Path

from mypy import api

from dex_agents import AgentFrameworkRunner, ToolExecutionResult

ROOT = Path(__file__).resolve().parents[2]

USES = '''
from typing import assert_type

from dex_agents import (
    AgentEvent, AgentFrameworkRunner, AgentSessionFlow, AgentTurnContext, DeferredToolExecution, DeferredToolOutcome,
    ToolEffect, ToolExecutionResult, ToolPolicy,
)
from dex_engine import Stream


async def bare(runner: AgentFrameworkRunner, call: DeferredToolExecution) -> None:
    assert_type(await runner.execute_deferred_tool_call(call), ToolExecutionResult)


async def asking(runner: AgentFrameworkRunner[DeferredToolOutcome], call: DeferredToolExecution) -> None:
    assert_type(await runner.execute_deferred_tool_call(call), DeferredToolOutcome)


def named(turn: AgentTurnContext, flow: AgentSessionFlow) -> None:
    assert_type(turn.resolve_tool_policy(name="lookup", framework_effect=ToolEffect.READ), ToolPolicy)
    assert_type(flow.agent_events, Stream[AgentEvent])
'''


def test_the_tool_outcome_defaults_to_tool_execution_result() -> None:
    [parameter] = AgentFrameworkRunner.__parameters__
    assert parameter.__default__ is ToolExecutionResult


def test_mypy_strict_accepts_a_bare_runner_as_returning_tool_execution_result(tmp_path: Path) -> None:
    uses = tmp_path / "uses.py"
    uses.write_text(USES)
    out, err, status = api.run([
        "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"), str(uses),
    ])
    assert status == 0, out + err
