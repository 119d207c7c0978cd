"""Worker processes on two "hosts" share one PostgreSQL server; one host is cut off mid-Step.

Each host is a network namespace of this machine (`ip netns`) joined to the root namespace by a veth
pair of its own /30: its worker reaches PostgreSQL over its own address, as a worker on another
machine would. The server is a private one started for the test (the shared test server listens on
127.0.0.1 only and must not be reconfigured); it listens on the hosts' gateway addresses.

Host A runs a Step that holds mid-Step at a FileGate while its worker keeps renewing its lease (the
hold awaits, the event loop runs on). The test cuts A off (its veth down): A's lease expires, host B
fails attempt 1 (WorkerLost) and runs the Step as attempt 2 to the flow's end, and A notices that
its connections are dead (TCP keepalives and tcp_user_timeout; A's URL shortens the store's
defaults, B runs on the defaults). Then A's handler is released while A is still cut off, so A's
worker sends its late commit into the dead link, and A's link comes back: the commit reaches the
server and must be refused there (E2), A must learn that it was declared dead, and must then work
normally again.

Needs: root, iproute2 (`ip netns`, veth), PostgreSQL 15's binaries (the ones `.ci/pg-start` uses) and
TEST_PG_DSN set (the pattern of every PostgreSQL test; the shared server itself is not used).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dex_engine import Store
from dex_engine._pg_store import IDLE_IN_TRANSACTION_TIMEOUT, NETWORK_TIMEOUTS

from .conftest import NO_PG_REASON, engine_for
from .proc_harness import ProcSet, WorkerProcess, assert_no_attempt_ran_twice, eventually
from .worker_child import REGISTRY, Owner

pytestmark = [pytest.mark.slow, pytest.mark.postgres]  # PostgreSQL only (docs/testing.md's -k postgres)

PG_BIN = Path("/usr/lib/postgresql/15/bin")
# Each host gets 10.77.<n>.0/30: .1 on the root namespace's end (where the server listens), .2 in its namespace.
SUBNET_PREFIX = "10.77"
# Concurrent runs of this test pick their subnets one at a time.
ALLOCATION_LOCK = Path(tempfile.gettempdir()) / "dex-multihost-net.lock"

# Host A's network timeouts, shorter than the store's defaults (NETWORK_TIMEOUTS in _pg_store.py) so
# that it notices the cut within the test: a dead idle connection after about 3 s, unacknowledged
# data after 2 s, a connection attempt after 2 s (libpq's minimum).
FAST_NETWORK_TIMEOUTS = "connect_timeout=2&keepalives_idle=1&keepalives_interval=1&keepalives_count=2" \
    "&tcp_user_timeout=2000"
# A session's server-side safeguards (set by the store on each new connection).
SERVER_SIDE_SETTINGS = ("SELECT current_setting('idle_in_transaction_session_timeout'),"
                        " current_setting('tcp_keepalives_idle'), current_setting('tcp_user_timeout')")
# What a worker logs when an operation fails on a dead connection (the store retries it).
CONNECTION_TROUBLE = ("database connection lost", ": poll failed", ": lease renewal failed")

BEFORE_COMMIT = "worker.before_commit"
INSIDE_COMMIT = "store.inside_commit"
AFTER_COMMIT = "worker.after_commit"


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _why_not_runnable() -> str | None:
    """The reason this machine cannot run the test, or None."""
    if not os.environ.get("TEST_PG_DSN"):
        return NO_PG_REASON
    if os.geteuid() != 0:
        return "the multi-host test needs root (it creates network namespaces and veth pairs)"
    if shutil.which("ip") is None:
        return "the multi-host test needs iproute2 (`ip`), which is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    if not (PG_BIN / "initdb").exists() or shutil.which("runuser") is None:
        return f"the multi-host test needs PostgreSQL 15's binaries ({PG_BIN}) and runuser"
    return None


# Hosts: one network namespace and veth pair each ----------------------------------------------------


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    host_if: str  # the root namespace's end of the veth pair: setting it down cuts the host off
    gateway: str  # address on host_if: the server listens here for this host
    address: str  # the host's own address, inside its namespace

    @property
    def exec_prefix(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.netns)

    def cut(self) -> None:
        _run("ip", "link", "set", self.host_if, "down")

    def reconnect(self) -> None:
        _run("ip", "link", "set", self.host_if, "up")


def _used_subnets() -> set[int]:
    used = set()
    for line in _run("ip", "-o", "-4", "addr", "show").splitlines() + _run("ip", "-4", "route").splitlines():
        for word in line.split():
            if word.startswith(f"{SUBNET_PREFIX}."):
                used.add(int(word.split(".")[2]))
    return used


@pytest.fixture
def hosts() -> Iterator[list[Host]]:
    """Two hosts, A and B, with names unique to this run; removed at the end whatever happens."""
    reason = _why_not_runnable()
    if reason is not None:
        pytest.skip(reason)
    token = secrets.token_hex(3)
    made: list[Host] = []
    try:
        with ALLOCATION_LOCK.open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            free = sorted(set(range(1, 255)) - _used_subnets())
            assert len(free) >= 2, f"no free {SUBNET_PREFIX}.x.0/30 subnets left"
            for name, n in zip("ab", random.sample(free, 2), strict=True):
                host = Host(name=name, netns=f"dex-mh-{token}-{name}", host_if=f"dxh{token}{name}",
                            gateway=f"{SUBNET_PREFIX}.{n}.1", address=f"{SUBNET_PREFIX}.{n}.2")
                ns_if = f"dxn{token}{name}"
                _run("ip", "netns", "add", host.netns)
                made.append(host)
                _run("ip", "link", "add", host.host_if, "type", "veth", "peer", "name", ns_if, "netns", host.netns)
                _run("ip", "addr", "add", f"{host.gateway}/30", "dev", host.host_if)
                _run("ip", "link", "set", host.host_if, "up")
                _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/30", "dev", ns_if)
                _run("ip", "-n", host.netns, "link", "set", ns_if, "up")
                _run("ip", "-n", host.netns, "link", "set", "lo", "up")
        yield made
    finally:
        for host in made:
            # Deleting one end of a veth pair deletes both; the namespace goes once no process is in it.
            with contextlib.suppress(RuntimeError):
                _run("ip", "link", "del", host.host_if)
            with contextlib.suppress(RuntimeError):
                _run("ip", "netns", "del", host.netns)


# A private PostgreSQL server ----------------------------------------------------------------------


def _as_postgres(*cmd: str) -> str:
    # `cwd="/"`: the postgres user may not be allowed into ours.
    done = subprocess.run(["runuser", "-u", "postgres", "--", *cmd], capture_output=True, text=True, cwd="/",
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stdout}{done.stderr}")
    return done.stdout


# initdb takes 2 s on an idle machine and over 30 s on a busy one; copying its result, a few. So the
# first run on a machine keeps a pristine cluster here (about 40 MB) and every run starts from a copy.
TEMPLATE = Path(tempfile.gettempdir()) / "dex-mh-pg15-template"
TEMPLATE_LOCK = Path(tempfile.gettempdir()) / "dex-mh-pg15-template.lock"


def _pristine_cluster() -> Path:
    """A cluster straight from initdb (trust authentication, UTF8, locale C), made once per machine."""
    with TEMPLATE_LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (TEMPLATE / "PG_VERSION").exists():
            shutil.rmtree(TEMPLATE, ignore_errors=True)
            staging = Path(tempfile.mkdtemp(prefix="dex-mh-pg15-initdb-"))
            try:
                shutil.chown(staging, "postgres", "postgres")
                _as_postgres(str(PG_BIN / "initdb"), "-D", str(staging / "data"), "-U", "postgres", "-A", "trust",
                             "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions")
                # Renamed into place only once complete: initdb writes PG_VERSION first.
                os.rename(staging / "data", TEMPLATE)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return TEMPLATE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True)
class PrivateServer:
    port: int
    data_dir: Path

    def url(self, address: str, query: str = "") -> str:
        # The cluster is the test's own: the engine's tables go into its `postgres` database.
        return f"postgresql://postgres@{address}:{self.port}/postgres" + (f"?{query}" if query else "")


@pytest.fixture
def server(hosts: list[Host]) -> Iterator[PrivateServer]:
    """A throwaway PostgreSQL 15 cluster listening on 127.0.0.1 and the hosts' gateways; removed after."""
    run_dir = Path(tempfile.mkdtemp(prefix="dex-mh-pg-"))
    shutil.chown(run_dir, "postgres", "postgres")
    data_dir = run_dir / "data"
    started = False
    try:
        _run("cp", "-a", str(_pristine_cluster()), str(data_dir))
        with (data_dir / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {SUBNET_PREFIX}.0.0/16 trust\n")
        for _ in range(5):  # the free port may be taken between the probe and the start
            port = _free_port()
            listen = ",".join(["127.0.0.1", *(h.gateway for h in hosts)])
            # Settings last in the file win. fsync off: a throwaway cluster, and durability is not under test.
            (data_dir / "postgresql.auto.conf").write_text(
                f"listen_addresses = '{listen}'\nport = {port}\nunix_socket_directories = '{data_dir}'\n"
                "max_connections = 100\nshared_buffers = 32MB\nfsync = off\n"
                "log_line_prefix = '%m [%p] %h %d '\nlog_lock_waits = on\n"
            )
            shutil.chown(data_dir / "postgresql.auto.conf", "postgres", "postgres")
            try:
                _as_postgres(str(PG_BIN / "pg_ctl"), "start", "-D", str(data_dir), "-l", str(data_dir / "server.log"),
                             "-w", "-t", "60")
            except RuntimeError:
                log = data_dir / "server.log"
                if log.exists() and "could not bind" in log.read_text():
                    continue
                raise
            started = True
            break
        assert started, f"the private server did not start; see {data_dir / 'server.log'}"
        yield PrivateServer(port, data_dir)
    finally:
        if started:
            with contextlib.suppress(RuntimeError):
                _as_postgres(str(PG_BIN / "pg_ctl"), "stop", "-D", str(data_dir), "-m", "immediate", "-w")
        shutil.rmtree(run_dir, ignore_errors=True)


# The test -----------------------------------------------------------------------------------------


def _client_addresses(server: PrivateServer) -> set[str]:
    """The addresses of every client connected to the server."""
    import psycopg

    with psycopg.connect(server.url("127.0.0.1"), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT DISTINCT host(client_addr) FROM pg_stat_activity WHERE client_addr IS NOT NULL"
        ).fetchall()
    return {str(r[0]) for r in rows}


# `ss -o`: "timer:(keepalive,7.488ms,0)" is 7.488 s to the next probe; "1min2sec", "119min", "980ms".
_KEEPALIVE_TIMER = re.compile(r"timer:\(keepalive,(?:(\d+)min)?(?:(\d+)(?:sec|\.))?(?:(\d+)ms)?,")


def _keepalive_timers(host: Host, server: PrivateServer) -> list[float]:
    """Seconds to the next keepalive probe on each of the host's idle connections to the server."""
    out = _run(*host.exec_prefix, "ss", "-tnoH", "state", "established", "dst", f"{host.gateway}:{server.port}")
    timers = []
    for match in _KEEPALIVE_TIMER.finditer(out):
        minutes, secs, ms = (int(g or 0) for g in match.groups())
        timers.append(minutes * 60 + secs + ms / 1000)
    return timers


@contextlib.contextmanager
def _report_on_failure(procs: ProcSet, server: PrivateServer) -> Iterator[None]:
    """On failure, print what the workers and the server logged (pytest shows it with the failure)."""
    try:
        yield
    except BaseException:
        for child in procs.children:
            print(f"--- output of worker {child.name} (pid {child.pid}) ---\n{child.output_text()[-6000:]}")
        log = server.data_dir / "server.log"
        print(f"--- server log ---\n{log.read_text(errors='replace')[-6000:] if log.exists() else '(none)'}")
        raise


async def _renewed_past(store: Store, pid: int, expiry_ms: int) -> bool:
    """The worker of process `pid` holds a lease that expires after `expiry_ms`."""
    return any(row[2] == pid and row[4] > expiry_ms for row in await store.list_workers())


async def test_cut_off_host_is_taken_over_and_its_late_commit_is_fenced(
    hosts: list[Host], server: PrivateServer, tmp_path: Path
) -> None:
    """A host cut off mid-Step loses the Step to another host, and its late commit is refused (E2).

    Proves, in order: both hosts' workers reach the server over their own addresses, with the
    store's network safeguards (B, on the defaults, probes its idle connections every
    keepalives_idle seconds, not the kernel's two hours; sessions carry the server-side idle
    transaction timeout, keepalive and tcp_user_timeout); A holding mid-Step keeps its lease for
    longer than a lease TTL (so what follows is the cut's doing); once A is cut off, the server
    ends A's sessions (so none can hold locks B needs), B takes the Step over (attempt 1
    WorkerLost, attempt 2 completes the flow) and A notices its dead connections; A's handler then
    returns and A's worker sends its commit, which is refused by the store's fencing once the link
    is back (A logs the result as discarded, never crosses the store's inside-commit gate); A
    learns it was declared dead, registers again and runs new work over its restored link.
    Throughout, flow state and history hold B's attempt only, and no attempt ran twice.
    """
    host_a, host_b = hosts
    async with engine_for(server.url("127.0.0.1"), REGISTRY, worker=False) as eng:
        with ProcSet(server.url("127.0.0.1"), tmp_path / "state") as procs:
            a = procs.start("a", db_url=server.url(host_a.gateway, FAST_NETWORK_TIMEOUTS),
                            command_prefix=host_a.exec_prefix, hold=("Slow",), hold_yields=True)
            b = procs.start("b", db_url=server.url(host_b.gateway), command_prefix=host_b.exec_prefix, standby=True)
            with _report_on_failure(procs, server):

                async def registered(*workers: WorkerProcess) -> dict[int, int]:
                    """pid -> lease expiry of each registered worker, when all of `workers` are registered."""
                    expiry = {row[2]: row[4] for row in await eng.store.list_workers()}
                    return expiry if {w.pid for w in workers} <= set(expiry) else {}

                await eng.client.start_flow("Zombie", "z", "commit")
                a_gate = procs.gate("z.Slow-1.1")
                assert await a_gate.wait_reached(60) == a.pid
                b.go()
                first_expiry = (await eventually("A and B to register", lambda: registered(a, b), 60))[a.pid]
                assert _client_addresses(server) >= {host_a.address, host_b.address}, (
                    "each host's worker must reach the server over its own address"
                )
                # B's URL sets no network parameters: the store's defaults apply to its connections...
                keepalive_idle = float(NETWORK_TIMEOUTS["keepalives_idle"])
                timers = await eventually("B's idle connections", lambda: _keepalive_timers(host_b, server), 30)
                assert max(timers) <= keepalive_idle, f"B's keepalive timers {timers} (expected <= {keepalive_idle} s)"
                # ...and each session has the server end it when left idle in a transaction, and probe
                # the client's side the same way (the test's own session: the same store code).
                settings = await eng.store._run(lambda db: db.one(SERVER_SIDE_SETTINGS), write=False)
                assert settings == (IDLE_IN_TRANSACTION_TIMEOUT, NETWORK_TIMEOUTS["keepalives_idle"],
                                    NETWORK_TIMEOUTS["tcp_user_timeout"]), settings
                # A's lease is renewed past a full TTL while its handler holds: only the cut can end it.
                await eventually("A to renew its lease while held",
                                 lambda: _renewed_past(eng.store, a.pid, first_expiry + 1000), 30)
                info = await eng.client.describe_flow("z")
                active = [(s.step_execution_id, s.state, s.attempt) for s in info.active_steps]
                assert active == [("Slow-1", "running", 1)], active

                assert not any(m in a.output_text() for m in CONNECTION_TROUBLE), a.output_text()
                host_a.cut()
                # The server gives up on A's sessions (server-side keepalive and tcp_user_timeout, from
                # A's URL), so a transaction A had open cannot hold the locks B needs.
                await eventually("the server to end the cut-off host's sessions",
                                 lambda: host_a.address not in _client_addresses(server), 60)
                info = await eng.client.wait_for_flow("z", 60)
                b_result = {"pid": b.pid, "attempt": 2}
                assert info.status == "completed", info
                assert await eng.client.flow_output("z") == b_result
                await eventually("A to notice that its connections are dead",
                                 lambda: any(m in a.output_text() for m in CONNECTION_TROUBLE), 60)

                # Still cut off, A's handler returns and its worker sends the late commit into the dead link.
                a_gate.release()
                await eventually("A's worker to send its late commit",
                                 lambda: BEFORE_COMMIT in procs.gates.crossings(a.pid), 30)
                host_a.reconnect()
                await eventually(
                    "A's late commit to be refused by the store",
                    lambda: "flow z: Slow-1 attempt 1 lost its task (taken over, or the flow ended); result discarded"
                    in a.output_text(), 60,
                )
                a_gates = procs.gates.crossings(a.pid)
                assert INSIDE_COMMIT not in a_gates and AFTER_COMMIT not in a_gates, (
                    f"A's late commit must be refused by the fencing check, before it changes anything: {a_gates}\n"
                    f"{a.output_text()[-4000:]}"
                )
                await eventually("A to learn it was declared dead", lambda: "was declared dead" in a.output_text(), 60)
                await eventually("A to register again", lambda: registered(a), 60)

                # Nothing of A's attempt got in.
                assert await eng.client.get_attribute("z", Owner) == b_result
                assert await eng.client.flow_output("z") == b_result
                history = await eng.client.get_flow_history("z")
                assert [h.attempt for h in history if h.event_type == "execute_completed"] == [2], history
                failed = [h for h in history if h.event_type == "attempt_failed"]
                assert [h.attempt for h in failed] == [1] and "WorkerLost" in failed[0].detail, history

                # A works again over its restored link: with B gone, it runs the next flow to its end.
                await b.stop()
                await eng.client.start_flow("Zombie", "z2", "commit")
                assert await procs.gate("z2.Slow-1.1").wait_reached(60) == a.pid
                procs.gate("z2.Slow-1.1").release()
                info = await eng.client.wait_for_flow("z2", 60)
                assert info.status == "completed", info
                assert await eng.client.flow_output("z2") == {"pid": a.pid, "attempt": 1}
                await a.stop()

                entries = procs.invocations.read()
                assert_no_attempt_ran_twice(entries)
                log = [(e.flow_id, e.attempt, e.phase, e.pid) for e in entries]
                assert log == [("z", 1, "start", a.pid), ("z", 2, "start", b.pid), ("z", 2, "end", b.pid),
                               ("z", 1, "end", a.pid), ("z2", 1, "start", a.pid), ("z2", 1, "end", a.pid)], log
                assert AFTER_COMMIT in procs.gates.crossings(b.pid)
