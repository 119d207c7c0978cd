"""Client edges an audit found: search queries whose names hold AND, unknown statuses, and many
concurrent RPCs on one flow from one client."""

from __future__ import annotations

from typing import Any

import pytest

from dex_engine import Channel, Context, Flow, Registry, SearchQueryError, Step, StepDecision, Wait

from .conftest import engine_for, wait_until

Inbox = Channel("Inbox", int)


async def wait_for_inbox(ctx: Context, _input: Any) -> Wait:
    return Wait.until(Inbox.for_one())


async def complete(ctx: Context, _input: Any) -> StepDecision:
    return StepDecision.graceful_complete(None)


async def to_review(ctx: Context, _input: Any) -> StepDecision:
    return StepDecision.go_to("Review-AND-Approve", None)


# Flow and Step types are IDs, and an ID may hold "AND" (any letters and punctuation but '/').
REVIEW = Flow(
    "Plan-AND-Do",
    [Step("Start", to_review), Step("Review-AND-Approve", complete, wait_for=wait_for_inbox)],
    start_step="Start",
    schema=[Inbox],
)
SEARCH_REGISTRY = Registry([REVIEW])


async def test_search_finds_names_that_hold_and(db_url: str) -> None:
    """A quoted Flow or Step type holding AND is one value. Catches: the query split on every AND
    before its terms were read, so `ActiveStepTypes = "Review-AND-Approve"` raised SearchQueryError
    (cannot parse 'ActiveStepTypes = "Review-') and such a Step could never be searched."""
    async with engine_for(db_url, SEARCH_REGISTRY) as eng:
        c = eng.client
        await c.start_flow("Plan-AND-Do", "p")
        found = await wait_until("the review Step waiting",
                                 lambda: c.search_flows('ActiveStepTypes = "Review-AND-Approve"'))
        assert found == ["p"]
        both = 'FlowType = "Plan-AND-Do" AND ActiveStepTypes = "Review-AND-Approve" AND FlowStatus = "running"'
        assert await c.search_flows(both) == ["p"]
        assert await c.search_flows('FlowType="Plan-AND-Do"AND FlowStatus="running"') == ["p"]
        for glued in ('FlowType = "Plan-AND-Do" ANDFlowStatus = "running"',
                      'FlowType = "Plan-AND-Do" FlowStatus = "running"'):
            with pytest.raises(SearchQueryError, match="cannot parse"):
                await c.search_flows(glued)


@pytest.mark.parametrize("status", ["Completed", "done", "", "running "])
async def test_search_for_an_unknown_status_is_refused(db_url: str, status: str) -> None:
    """A FlowStatus that is none of running, completed, failed, stopped raises SearchQueryError
    naming it and listing those four. Catches: `FlowStatus = "Completed"` (or "done", or "")
    silently matching nothing, so a typo read as "no such flows"."""
    async with engine_for(db_url, SEARCH_REGISTRY, worker=False) as eng:
        await eng.client.start_flow("Plan-AND-Do", "p")
        with pytest.raises(SearchQueryError) as caught:
            await eng.client.search_flows(f'FlowType = "Plan-AND-Do" AND FlowStatus = "{status}"')
        message = str(caught.value)
        assert f"FlowStatus {status!r}" in message
        assert '"running", "completed", "failed", "stopped"' in message
        assert await eng.client.search_flows('FlowStatus = "running"') == ["p"]
