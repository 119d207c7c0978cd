"""`dex-engine demo`: an online order run by an in-process worker and client on one SQLite file.

The Order flow shows the engine's main pieces in a few seconds:

    Validate -> Reserve (fails once, retried) -> AwaitPayment (waits on channel Payments, fed by RPC `pay`)
      -> Pack + Invoice in parallel, joined by Ship (waits for 2 messages on channel Ready)
      -> Deliver (waits on a 1 s durable timer) -> flow completed

Every Execute writes best-effort stream events (`ctx.write_event`) to the stream `Progress`.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.text import Text

from ._client import AsyncClient
from ._context import Context, RpcContext
from ._decision import StepDecision
from ._errors import FlowNotFoundError
from ._flow import Flow, Registry, Step, rpc
from ._open import shown_url
from ._options import StepOptions
from ._records import HistoryEntry, StoredEvent
from ._retry import RetryPolicy
from ._schema import Attribute, AttributeMap, Channel, Stream
from ._store import Store
from ._wait import Timer, Wait
from ._worker import AsyncWorker, WorkerOptions

FLOW_TYPE = "Order"
PROGRESS_STREAM = "Progress"
# Seconds the whole demo may take before it gives up (it normally needs about 2 s).
DEMO_TIMEOUT_SECONDS = 60.0
# Prices in cents: the demo's whole catalogue.
PRICES = {"espresso-beans": 1450, "grinder": 8900, "paper-filters": 350}


@dataclass
class OrderRequest:
    """The flow input: who orders what (item -> quantity)."""

    customer: str
    items: dict[str, int]


@dataclass
class Payment:
    """What the RPC `pay` accepts and publishes on channel Payments."""

    method: str
    amount_cents: int


# Schema ------------------------------------------------------------------------------------

OrderAttr: Attribute[OrderRequest] = Attribute("Order", OrderRequest)
Status: Attribute[str] = Attribute("Status", str)
TotalCents: Attribute[int] = Attribute("TotalCents", int)
Paid: Attribute[Payment] = Attribute("Paid", Payment)
Tracking: Attribute[str] = Attribute("Tracking", str)
Work: AttributeMap[str] = AttributeMap("Work", str)  # one key per parallel Step: "pack", "invoice"
Payments: Channel[Payment] = Channel("Payments", Payment)
Ready: Channel[str] = Channel("Ready", str)  # the parallel Steps announce themselves here; Ship joins on it
Progress: Stream[str] = Stream(PROGRESS_STREAM, str)


# Steps -------------------------------------------------------------------------------------


async def validate(ctx: Context, order: OrderRequest) -> StepDecision:
    unknown = sorted(set(order.items) - set(PRICES))
    if unknown:
        return StepDecision.force_fail(f"unknown items {unknown}; the catalogue has {sorted(PRICES)}")
    total = sum(PRICES[item] * n for item, n in order.items.items())
    ctx.set(OrderAttr, order)
    ctx.set(TotalCents, total)
    ctx.set(Status, "validated")
    ctx.write_event(Progress, f"{sum(order.items.values())} items for {order.customer}, total {_money(total)}")
    return StepDecision.go_to("Reserve", order)


class InventoryUnavailable(ConnectionError):
    """The (simulated) inventory service did not answer."""


async def reserve(ctx: Context, order: OrderRequest) -> StepDecision:
    ctx.write_event(Progress, f"reserving stock (last checkpoint {ctx.checkpoint!r})")
    # A durable checkpoint: the next attempt of this Step reads it (and the attempt counts as started).
    await ctx.heartbeat("asked the inventory service")
    if ctx.attempt == 1:
        raise InventoryUnavailable("inventory service timed out (simulated; the engine retries the Step)")
    ctx.set(Status, "reserved")
    return StepDecision.go_to("AwaitPayment", None)


async def await_payment_wait(ctx: Context, _: None) -> Wait:
    ctx.set(Status, "awaiting payment")
    return Wait.until(Payments.for_one())


async def await_payment(ctx: Context, _: None) -> StepDecision:
    assert ctx.wait_result is not None
    (payment,) = ctx.wait_result.messages(Payments)
    ctx.set(Paid, payment)
    ctx.set(Status, "paid")
    ctx.write_event(Progress, f"paid {_money(payment.amount_cents)} by {payment.method}; packing and invoicing")
    # Three Steps at once: two workers of the order, and the Step that joins them.
    return StepDecision.go_to_many(("Pack", None), ("Invoice", None), ("Ship", None))


async def pack(ctx: Context, _: None) -> StepDecision:
    order = ctx.get(OrderAttr)
    assert order is not None
    ctx.set(Work["pack"], f"{sum(order.items.values())} items in one box")
    ctx.write_event(Progress, "packed")
    ctx.publish(Ready, "pack")
    return StepDecision.dead_end()


async def invoice(ctx: Context, _: None) -> StepDecision:
    ctx.set(Work["invoice"], f"invoice INV-{ctx.flow_id} for {_money(ctx.get(TotalCents) or 0)}")
    ctx.write_event(Progress, "invoiced")
    ctx.publish(Ready, "invoice")
    return StepDecision.dead_end()


async def ship_wait(ctx: Context, _: None) -> Wait:
    return Wait.until(Ready.for_n(2))


async def ship(ctx: Context, _: None) -> StepDecision:
    assert ctx.wait_result is not None
    joined = sorted(ctx.wait_result.messages(Ready))
    tracking = f"DEX-{ctx.flow_id.upper()}"
    ctx.set(Tracking, tracking)
    ctx.set(Status, "shipped")
    ctx.write_event(Progress, f"{' and '.join(joined)} done; shipped as {tracking}, courier on the way")
    return StepDecision.go_to("Deliver", None)


async def deliver_wait(ctx: Context, _: None) -> Wait:
    return Wait.until(Timer.by_duration(1))


async def deliver(ctx: Context, _: None) -> StepDecision:
    assert ctx.wait_result is not None and ctx.wait_result.timer_fired
    ctx.set(Status, "delivered")
    ctx.write_event(Progress, "delivered")
    return StepDecision.graceful_complete({
        "order": ctx.flow_id, "status": "delivered", "tracking": ctx.get(Tracking),
        "total_cents": ctx.get(TotalCents),
    })


@rpc(request_type=Payment)
async def pay(ctx: RpcContext, payment: Payment) -> str:
    """Accept a payment of the exact total; a refused payment raises and commits nothing."""
    total = ctx.get(TotalCents)
    if total is None:
        raise ValueError("the order is not validated yet")
    if payment.amount_cents != total:
        raise ValueError(f"amount {_money(payment.amount_cents)} does not match the total {_money(total)}")
    if ctx.get(Paid) is not None or ctx.pending(Payments):
        return "already paid"
    ctx.publish(Payments, payment)
    return f"payment of {_money(payment.amount_cents)} accepted"


ORDER_FLOW = Flow(
    FLOW_TYPE,
    [
        Step("Validate", validate, input_type=OrderRequest),
        Step("Reserve", reserve, input_type=OrderRequest, options=StepOptions(
            execute_retry=RetryPolicy(max_attempts=3, initial_interval_seconds=0.5))),
        Step("AwaitPayment", await_payment, wait_for=await_payment_wait, input_type=type(None)),
        Step("Pack", pack, input_type=type(None)),
        Step("Invoice", invoice, input_type=type(None)),
        Step("Ship", ship, wait_for=ship_wait, input_type=type(None)),
        Step("Deliver", deliver, wait_for=deliver_wait, input_type=type(None)),
    ],
    start_step="Validate",
    schema=[OrderAttr, Status, TotalCents, Paid, Tracking, Work, Payments, Ready, Progress],
    rpcs=[pay],
)

REGISTRY = Registry([ORDER_FLOW])

ORDER = OrderRequest(customer="Ada", items={"espresso-beans": 2, "grinder": 1, "paper-filters": 1})


# Driver ------------------------------------------------------------------------------------


class DemoError(Exception):
    """The demo flow did not complete."""


@dataclass(frozen=True)
class DemoResult:
    flow_id: str
    status: str
    output: Any
    seconds: float


# Notes printed under the history events that show a feature off.
_NOTES: dict[tuple[str, str], str] = {
    ("Reserve", "attempt_failed"): "the attempt failed; RetryPolicy runs attempt 2 in 0.5 s",
    ("AwaitPayment", "wait_registered"): "durable wait on channel Payments: no worker or coroutine is held",
    ("Ship", "wait_registered"): "join: waits for 2 messages on channel Ready, one from each parallel Step",
    ("Deliver", "wait_registered"): "durable timer: Timer.by_duration(1)",
}

_EVENT_STYLES = {
    "step_scheduled": "dim",
    "wait_registered": "yellow",
    "wait_completed": "cyan",
    "execute_completed": "green",
    "attempt_failed": "red",
    "step_failed": "bold red",
    "step_cancelled": "magenta",
    "flow_closed": "bold",
}


class _Narrator:
    """Prints the flow's history as it grows, each stream event just before the commit of its attempt."""

    def __init__(self, console: Console, store: Store, flow_id: str) -> None:
        self.console = console
        self.store = store
        self.flow_id = flow_id
        self.started_ms = time.time() * 1000
        self.history: list[HistoryEntry] = []
        self.after = 0  # last stream sequence read
        self.events: list[StoredEvent] = []  # read, not printed yet

    async def catch_up(self, *, final: bool = False) -> None:
        # Events first: an attempt's events are stored before its commit, so the history read next
        # holds the commit of every event whose attempt has ended.
        page = await self.store.read_events(self.flow_id, PROGRESS_STREAM, self.after, 1000)
        self.events.extend(page.events)
        self.after = page.events[-1].sequence if page.events else self.after
        seen = len(self.history)
        self.history = await self.store.history(self.flow_id)
        for entry in self.history[seen:]:
            if entry.event_type in ("execute_completed", "attempt_failed"):
                self._print_events(entry.step_execution_id, entry.attempt)
            self._print_entry(entry)
        if final:
            self._print_events(None, None)

    def _print_events(self, step_execution_id: str | None, attempt: int | None) -> None:
        """Print (and drop) the buffered events of one attempt; every one when both are None."""
        keep: list[StoredEvent] = []
        for event in self.events:
            if step_execution_id is not None and (event.step_execution_id, event.attempt) != (
                step_execution_id, attempt,
            ):
                keep.append(event)
                continue
            line = Text(f"{'':11}stream ", style="dim")
            line.append(f"{PROGRESS_STREAM}#{event.sequence} ", style="blue")
            line.append(f"{event.step_execution_id} attempt {event.attempt}: ", style="dim")
            line.append(str(json.loads(event.value)), style="blue")
            self.console.print(line)
        self.events = keep

    def _print_entry(self, entry: HistoryEntry) -> None:
        line = Text(f"  +{(entry.at_ms - self.started_ms) / 1000:5.2f}s  ", style="dim")
        line.append(f"{entry.step_execution_id or self.flow_id:<15}", style="bold")
        line.append(f"{entry.event_type:<18}", style=_EVENT_STYLES.get(entry.event_type, ""))
        if entry.attempt:
            line.append(f"attempt {entry.attempt}  ", style="dim")
        line.append(entry.detail)
        self.console.print(line)
        note = _NOTES.get((entry.step_type, entry.event_type))
        if note:
            self.console.print(Text(f"{'':11}<- {note}", style="italic dim"))

    def saw(self, step_type: str, event_type: str) -> bool:
        return any(h.step_type == step_type and h.event_type == event_type for h in self.history)


def demo_options(url: str) -> WorkerOptions:
    """Worker timings for a snappy demo: timers fire within about 0.1 s of being due."""
    return WorkerOptions(database_url=url, housekeeping_seconds=0.1, poll_seconds=0.01, shutdown_grace_seconds=2.0)


async def _new_flow_id(store: Store) -> str:
    """`order-1`, or the next free `order-<n>` when the database already holds demo flows."""
    n = 1
    while True:
        flow_id = f"order-{n}"
        try:
            await store.describe_flow(flow_id)
        except FlowNotFoundError:
            return flow_id
        n += 1


async def run_demo(store: Store, console: Console) -> DemoResult:
    """Run one Order flow to completion on `store` with an in-process worker, narrating on `console`."""
    worker = AsyncWorker(REGISTRY, demo_options(store.url), store=store)
    client = AsyncClient(REGISTRY, store=store)
    async with worker:
        console.print(Text.assemble(("worker ", "dim"), (worker.worker_id, "bold"),
                                    (" and a client run in this process, on one database", "dim")))
        flow_id = await _new_flow_id(store)
        return await _drive(console, store, client, flow_id)


async def _drive(console: Console, store: Store, client: AsyncClient, flow_id: str) -> DemoResult:
    narrator = _Narrator(console, store, flow_id)
    console.print(Text.assemble(("\n> ", "bold cyan"), f"start_flow({FLOW_TYPE!r}, {flow_id!r}, ",
                                (json.dumps(ORDER.__dict__), "dim"), ")"))
    await client.start_flow(FLOW_TYPE, flow_id, ORDER)
    paid = False
    deadline = time.monotonic() + DEMO_TIMEOUT_SECONDS
    while True:
        info = await store.describe_flow(flow_id)
        await narrator.catch_up(final=info.status != "running")
        if info.status != "running":
            break
        if not paid and narrator.saw("AwaitPayment", "wait_registered"):
            await _pay(console, client, flow_id)
            paid = True
        if time.monotonic() > deadline:
            steps = [f"{s.step_execution_id} ({s.state})" for s in info.active_steps]
            raise DemoError(f"flow {flow_id!r} still running after {DEMO_TIMEOUT_SECONDS:.0f} s; active Steps {steps}")
        await asyncio.sleep(0.05)
    seconds = ((info.closed_at_ms or info.created_at_ms) - info.created_at_ms) / 1000
    output = None if info.output is None else json.loads(info.output)
    if info.status != "completed":
        raise DemoError(f"flow {flow_id!r} ended {info.status}: {info.error}")
    return DemoResult(flow_id, info.status, output, seconds)


async def _pay(console: Console, client: AsyncClient, flow_id: str) -> None:
    """The customer pays: first a wrong amount (refused, nothing committed), then the right one."""
    total = await client.get_attribute(flow_id, TotalCents)
    assert total is not None
    for amount in (total - 100, total):
        console.print(Text.assemble(("> ", "bold cyan"), f"rpc({flow_id!r}, 'pay', amount {_money(amount)})"))
        try:
            answer = await client.rpc(flow_id, "pay", Payment("card", amount))
        except ValueError as exc:
            console.print(Text(f"           refused: {exc} (the RPC committed nothing)", style="red"))
            continue
        console.print(Text(f"           {answer}", style="green"))


def print_summary(console: Console, url: str, result: DemoResult) -> None:
    """The outcome and the CLI commands to look at the flow next."""
    console.print(Text.assemble(
        ("\nflow ", "bold"), (result.flow_id, "bold"), (f" {result.status} in {result.seconds:.1f} s; output ", "bold"),
        (json.dumps(result.output), "green"),
    ))
    # Printed without its password (a terminal is recorded, shared, pasted); the user knows it.
    shown = shown_url(url)
    db = shlex.quote(shown)
    fid = shlex.quote(result.flow_id)
    commands = "\n".join(f"  {c}" for c in [
        f"dex-engine describe {fid} --db {db}",
        f"dex-engine history {fid} --db {db}",
        f"dex-engine attributes {fid} --db {db}",
        f"dex-engine stream {fid} {PROGRESS_STREAM} --db {db}",
        f"dex-engine list --db {db}",
    ])
    console.print(Text("\nLook at it with the CLI (in this repository, prefix each with `uv run`):", style="bold"))
    # soft_wrap: never break a command across lines, so it can be copied as is.
    console.print(Text(commands), soft_wrap=True)
    console.print(Text(f"(or export DEX_ENGINE_DB={db} and drop --db)", style="dim"), soft_wrap=True)
    if shown != url:
        console.print(Text("(the password is written as ***: put yours back in the URL)", style="dim"))


def _money(cents: int) -> str:
    return f"{cents / 100:.2f} EUR"
