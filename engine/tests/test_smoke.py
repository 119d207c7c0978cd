from __future__ import annotations

from dex_engine import (
    Attribute,
    Channel,
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
