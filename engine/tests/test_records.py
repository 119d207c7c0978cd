"""The small rules records carry: when a WriteSet or an RPC's outcome has nothing to commit (an RPC
that changed nothing commits nothing), which leases commit durably, and the stored form of a wait's
outcome."""

from __future__ import annotations

import msgspec
import pytest

from dex_engine import LoadOptions, RetryPolicy, StepDurability
from dex_engine._codec import decode_json, encode_json
from dex_engine._options import MethodOptions, TaskOptions
from dex_engine._records import (
    ConsumedMessage,
    Lease,
    MovementRecord,
    RetryWaitEnding,
    RpcOutcome,
    WaitOutcome,
    WriteSet,
)


def test_a_write_set_is_empty_only_with_nothing_of_any_kind() -> None:
    assert WriteSet().empty()
    for one in (
        WriteSet(attributes={("A", ""): None}),  # a delete is a change too
        WriteSet(publishes=[("Inbox", "", b"1")]),
        WriteSet(appends=[("Log", 1024, b"1")]),
        WriteSet(deleted_messages=[("Inbox", "", 3)]),
    ):
        assert not one.empty(), one


def test_an_rpc_outcome_writes_nothing_only_with_nothing_of_any_kind() -> None:
    """An RPC that only starts a Step, only cancels one or only ends retry waits still commits: the
    locked try (Store.rpc_locked) skips the commit of an outcome that writes nothing. Catches a
    handler returning RPCResult(canceling_steps=...) or (ending_retry_waits=...) and nothing else,
    run under the flow's write lock, committing nothing."""
    def outcome(**changes: object) -> RpcOutcome:
        fields: dict[str, object] = {"output": None, "writes": WriteSet(), "records": [], "canceling": (),
                                     "ending": None}
        return RpcOutcome(**{**fields, **changes})  # type: ignore[arg-type]

    options = TaskOptions(has_wait_for=False, execute=MethodOptions(retry=RetryPolicy()))
    assert outcome(output="answered").writes_nothing()  # the output alone is no change
    for one in (
        outcome(writes=WriteSet(publishes=[("Inbox", "", b"1")])),
        outcome(records=[MovementRecord("Extra", b"null", options)]),
        outcome(canceling=("Listen",)),
        outcome(ending=RetryWaitEnding(("Work",), "stopped by the user")),
    ):
        assert not one.writes_nothing(), one


def test_a_wait_outcome_is_stored_in_the_form_earlier_versions_wrote() -> None:
    """A satisfied wait's outcome is stored with its task until its Execute runs, so a worker of a
    newer dex_engine reads outcomes an older one wrote: its consumed messages as [id, value] pairs,
    defaults left out. Catches a change of the stored form (such as a message as an object), which
    fails every such Execute after an upgrade."""
    outcome = WaitOutcome(satisfied=(1,), consumed=((), (ConsumedMessage(7, msgspec.Raw(b'"hi"')),)))
    stored = b'{"satisfied":[1],"consumed":[[],[[7,"hi"]]]}'
    assert encode_json(outcome) == stored
    read = decode_json(stored, WaitOutcome)
    assert (read.satisfied, read.fired_timers, read.skipped) == ((1,), (), False)
    assert [[(m.message_id, bytes(m.value)) for m in c] for c in read.consumed] == [[], [(7, b'"hi"')]]
    assert encode_json(WaitOutcome(skipped=True)) == b'{"skipped":true}'


@pytest.mark.parametrize(("durability", "durable"), [
    (StepDurability.SYNC, True), (StepDurability.ASYNC, False), (None, True),
])
def test_only_an_async_steps_lease_commits_without_its_fsync(durability: StepDurability | None, durable: bool) -> None:
    options = TaskOptions(has_wait_for=False, execute=MethodOptions(retry=RetryPolicy()), durability=durability)
    lease = Lease(task_id=1, lease_epoch=1, flow_id="f", flow_type="F", step_type="S", step_execution_id="S-1",
                  method="execute", attempt=1, input=b"null", options=options, load=LoadOptions.all(), attributes={},
                  checkpoint=None, wait_spec=None, wait_outcome=None, recovery_error=None)
    assert lease.durable is durable
