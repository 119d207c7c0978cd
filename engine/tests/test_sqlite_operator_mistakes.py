"""An operator's mistakes on the one-machine SQLite deployment while worker processes run: the file
deleted or moved under them. No process may go on using a file other processes no longer see."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dex_engine import StoreOpenError, open_store

from .conftest import engine_for
from .proc_harness import ProcSet
from .worker_child import COUNTER_STEPS, REGISTRY, Count

pytestmark = pytest.mark.slow


def _rename(source: str, target: str) -> None:
    os.rename(source, target)


def _remove(path: Path, how: str) -> None:
    if how == "mv":
        os.rename(path, f"{path}.old")  # its -wal and -shm stay at the old names, as mv leaves them
    else:
        for suffix in ("", "-wal", "-shm"):  # rm dex.db dex.db-wal dex.db-shm
            os.unlink(f"{path}{suffix}")


async def _run_counter(db_url: str, flow_id: str) -> None:
    async with engine_for(db_url, REGISTRY, worker=False) as eng:
        await eng.client.start_flow("Counter", flow_id, 1)
        info = await eng.client.wait_for_flow(flow_id, 60.0)
        assert info.status == "completed", info
        assert await eng.client.get_attribute(flow_id, Count) == COUNTER_STEPS


@pytest.mark.parametrize("how", ["rm", "mv"])
async def test_a_worker_process_whose_file_is_deleted_or_moved_exits_naming_it(tmp_path: Path, how: str) -> None:
    """A worker process runs flows on dex.db; the operator deletes it (with its -wal and -shm) or moves
    it away. The old worker exits (non-zero) with DatabaseFileReplacedError naming the file, so a
    supervisor would start it again; a flow started in the new file at that path (after the deletion
    at once, and in the other case once the old worker is gone with the -wal mv left behind) runs on a
    worker started on the path, and a moved file keeps what the old worker committed. Catches: the
    old worker living on, its writes refused and only logged, while nothing ran the new file's flows."""
    path = tmp_path / "dex.db"
    db_url = f"sqlite:///{path}"
    with ProcSet(db_url, tmp_path / "state") as procs:
        old = procs.start("old", gate_log=False, log_fsync=False)
        await _run_counter(db_url, "before")
        _remove(path, how)
        if how == "rm":
            async with engine_for(db_url, REGISTRY, worker=False) as eng:
                await eng.client.start_flow("Counter", "after", 1)
        rc = await old.wait_exit(60.0)
        output = old.output_text()
        assert rc != 0, output
        assert f"DatabaseFileReplacedError: database file {str(path)!r} was deleted or replaced" in output
        if how == "mv":
            # SQLite does not checkpoint a moved file on close: the last commits are in the -wal mv
            # left behind, and the path is refused until it is moved along, as the error advises.
            with pytest.raises(StoreOpenError, match="moved or deleted while processes had it open"):
                open_store(db_url)
            _rename(f"{path}-wal", f"{path}.old-wal")
            os.unlink(f"{path}-shm")
            async with engine_for(f"sqlite:///{path}.old", REGISTRY, worker=False) as moved:
                assert await moved.client.get_attribute("before", Count) == COUNTER_STEPS
            async with engine_for(db_url, REGISTRY, worker=False) as eng:
                await eng.client.start_flow("Counter", "after", 1)
        procs.start("new", gate_log=False, log_fsync=False)
        async with engine_for(db_url, REGISTRY, worker=False) as eng:
            info = await eng.client.wait_for_flow("after", 60.0)
            assert info.status == "completed", info
            assert not await eng.client.exists("before")
