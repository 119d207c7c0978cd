"""The small rules records carry: when a WriteSet has nothing to commit (an RPC that changed nothing
commits nothing), and which leases commit durably."""

from __future__ import annotations

import pytest

from dex_engine import LoadOptions, RetryPolicy, StepDurability
from dex_engine._options import MethodOptions, TaskOptions
from dex_engine._records import Lease, WriteSet


def test_a_write_set_is_empty_only_with_nothing_of_any_kind() -> None:
    assert WriteSet().empty()
    for one in (
        WriteSet(attributes={("A", ""): None}),  # a delete is a change too
        WriteSet(publishes=[("Inbox", "", b"1")]),
        WriteSet(appends=[("Log", 1024, b"1")]),
        WriteSet(deleted_messages=[("Inbox", "", 3)]),
    ):
        assert not one.empty(), one


@pytest.mark.parametrize(("durability", "durable"), [
    (StepDurability.SYNC, True), (StepDurability.ASYNC, False), (None, True),
])
def test_only_an_async_steps_lease_commits_without_its_fsync(durability: StepDurability | None, durable: bool) -> None:
    options = TaskOptions(has_wait_for=False, execute=MethodOptions(retry=RetryPolicy()), durability=durability)
    lease = Lease(task_id=1, lease_epoch=1, flow_id="f", flow_type="F", step_type="S", step_execution_id="S-1",
                  method="execute", attempt=1, input=b"null", options=options, load=LoadOptions.all(), attributes={},
                  checkpoint=None, wait_spec=None, wait_outcome=None, recovery_error=None)
    assert lease.durable is durable
