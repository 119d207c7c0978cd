"""Plans on the engine: the execute_plan RPC, and the plan hooks of the Flow and AwaitUserMessage.

The rules themselves are pure, in _plans.py. Here they meet the engine: the Flow constructor's
plan-mode check, the PlanExecutions condition AwaitUserMessage waits on while a plan is draft or
active, reading the approval it consumed, and execute_plan, which declares the PendingPlanExecution
lock (seed 002 "RPCs", "Rules") and serializes by the flow's version.
"""

from __future__ import annotations

from typing import Any

from dex_engine import ChannelCondition, LoadOptions, Rpc, RpcContext, WaitResult, rpc

from ._persistence import (
    AGENT_PLAN,
    AGENT_STATE,
    PENDING_INTERRUPTS,
    PENDING_PLAN_EXECUTION,
    PLAN_EXECUTIONS,
    QUEUED_USER_MESSAGES,
    STEERED_USER_MESSAGES,
    plan_execution_key,
)
from ._plans import execute_plan_accepted, is_executable, plan_mode_problems
from ._runtime import pending_interrupts, waiting_user_messages
from ._wire import AgentPlan, ExecutePlanRequest, PlanExecutionRequest


def check_plan_mode(runner: object, plan_mode_enabled: bool, built_in_tools: frozenset[Any]) -> None:
    """The Flow constructor's check: plan mode needs write_todos and a PlanModeRunner."""
    problems = plan_mode_problems(plan_mode_enabled, built_in_tools, runner)
    if problems:
        raise ValueError("cannot enable plan mode: " + "; ".join(problems))


def plan_execution_conditions(plan: AgentPlan | None) -> list[ChannelCondition]:
    """AwaitUserMessage's last wait condition: an approval of the current revision, while the plan is
    draft or active. An approval of a revision a later write replaced stays unconsumed, never runs."""
    if plan is None or not is_executable(plan):
        return []
    return [PLAN_EXECUTIONS[plan_execution_key(plan.revision)].for_one()]


def consumed_plan_executions(wait_result: WaitResult) -> list[PlanExecutionRequest]:
    """The approvals the wait consumed (at most one: the condition takes one message)."""
    if wait_result.spec is None:  # a Step without a WaitFor: AwaitUserMessage always has one
        return []
    out: list[PlanExecutionRequest] = []
    for index, condition in enumerate(wait_result.spec.conditions):
        if condition.kind == "channel" and condition.channel == PLAN_EXECUTIONS.name:
            out.extend(wait_result.messages_at(index))
    return out


def plan_rpcs() -> list[Rpc]:
    """The plan RPCs of every agent session Flow."""

    @rpc("execute_plan", request_type=ExecutePlanRequest, locks=[PENDING_PLAN_EXECUTION],
         load=LoadOptions.only(AGENT_STATE, AGENT_PLAN, PENDING_PLAN_EXECUTION, PENDING_INTERRUPTS))
    async def execute_plan(ctx: RpcContext, request: ExecutePlanRequest) -> bool:
        # The seed's lock: it conflicts only with a Step holding it (E7), and no Step does, so it
        # never raises. Concurrent calls serialize by the flow's version instead (E8): the second
        # runs again on the first's commit and sees the pending approval, so a second approval is
        # refused until AwaitUserMessage consumes the first, including while its Execute has not
        # committed.
        pending = ctx.get(PENDING_PLAN_EXECUTION)
        accepted = execute_plan_accepted(
            request.revision, state=ctx.get(AGENT_STATE), plan=ctx.get(AGENT_PLAN),
            pending_execution_revision=None if pending is None else pending.revision,
            queued_message_count=len(waiting_user_messages(ctx, QUEUED_USER_MESSAGES)),
            steered_message_count=len(waiting_user_messages(ctx, STEERED_USER_MESSAGES)),
            pending_interrupt_count=len(pending_interrupts(ctx)),
        )
        if not accepted:
            return False
        approval = PlanExecutionRequest(revision=request.revision)
        ctx.set(PENDING_PLAN_EXECUTION, approval)
        ctx.publish(PLAN_EXECUTIONS[plan_execution_key(request.revision)], approval)
        return True

    return [execute_plan]
