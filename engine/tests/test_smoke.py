from __future__ import annotations

import asyncio
import threading
import time

import pytest

from dex_engine import (
    Attribute,
    Channel,
    Client,
    Context,
    Flow,
    Registry,
    RpcContext,
    Step,
    StepDecision,
    Wait,
    rpc,
)

from .conftest import engine_for

Count = Attribute("Count", int)
Inbox = Channel("Inbox", str)


async def count(ctx: Context, n: int) -> StepDecision:
    ctx.set(Count, (ctx.get(Count) or 0) + 1)
    if n <= 1:
        return StepDecision.go_to("Listen", None)
    return StepDecision.go_to("Count", n - 1)


async def listen_wait(ctx: Context, _: None) -> Wait:
    return Wait.until(Inbox.for_one())


async def listen(ctx: Context, _: None) -> StepDecision:
    assert ctx.wait_result is not None
    (msg,) = ctx.wait_result.messages(Inbox)
    return StepDecision.graceful_complete({"count": ctx.get(Count), "msg": msg})


@rpc(request_type=str)
async def say(ctx: RpcContext, text: str) -> int:
    ctx.publish(Inbox, text)
    return ctx.get(Count) or 0


FLOW = Flow(
    "Smoke",
    [Step("Count", count, input_type=int), Step("Listen", listen, wait_for=listen_wait, input_type=type(None))],
    start_step="Count",
    schema=[Count, Inbox],
    rpcs=[say],
)


async def test_chain_wait_and_rpc(db_url: str) -> None:
    async with engine_for(db_url, Registry([FLOW])) as eng:
        await eng.client.start_flow("Smoke", "f1", 5)
        from .conftest import wait_until

        async def listening() -> bool:
            info = await eng.client.describe_flow("f1")
            return any(s.step_type == "Listen" and s.state == "waiting" for s in info.active_steps)

        await wait_until("Listen waiting", listening)
        assert await eng.client.rpc("f1", "say", "hello") == 5
        info = await eng.client.wait_for_flow("f1", 10)
        assert info.status == "completed"
        assert await eng.client.flow_output("f1") == {"count": 5, "msg": "hello"}


async def test_the_blocking_client_drives_a_flow(db_url: str) -> None:
    """Client, the blocking twin of AsyncClient, from a plain thread: start a flow, find it waiting,
    read its state, call an RPC, publish, read history, stop another flow, and close its loop thread."""
    def until_listening(client: Client, flow_id: str) -> None:
        deadline = time.monotonic() + 10
        while not any(s.step_type == "Listen" and s.state == "waiting"
                      for s in client.describe_flow(flow_id).active_steps):
            assert time.monotonic() < deadline, f"{flow_id} never waited in Listen"
            time.sleep(0.01)

    def drive() -> None:
        with Client(Registry([FLOW]), db_url) as client:
            client.start_flow("Smoke", "b1", 3)
            until_listening(client, "b1")
            assert client.search_flows('ActiveStepTypes = "Listen"') == ["b1"]
            assert client.get_attribute("b1", Count) == 3
            assert client.rpc("b1", "say", "by rpc") == 3
            assert client.wait_for_flow("b1", 10).status == "completed"
            assert "execute_completed" in {e.event_type for e in client.get_flow_history("b1")}

            client.start_flow("Smoke", "b2", 1)
            until_listening(client, "b2")
            client.publish("b2", Inbox, "published")
            assert client.wait_for_flow("b2", 10).status == "completed"

            client.start_flow("Smoke", "b3", 1)
            until_listening(client, "b3")
            client.stop_flow("b3", "not needed")
            stopped = client.wait_for_flow("b3", 10)
            assert (stopped.status, stopped.error) == ("stopped", "not needed")
        # Closing joins its event-loop thread and closes the store it opened.
        assert "dex-client" not in {t.name for t in threading.enumerate()}
        with pytest.raises(RuntimeError, match="is closed"):
            asyncio.run(client._async.store.describe_flow("b1"))

    async with engine_for(db_url, Registry([FLOW])) as eng:
        await asyncio.to_thread(drive)
        assert await eng.client.flow_output("b2") == {"count": 1, "msg": "published"}
