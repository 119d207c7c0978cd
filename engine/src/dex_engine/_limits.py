"""Every limit and default of the engine, each with the reason for its value."""

from __future__ import annotations

# Encoded JSON size of one attribute value, message, input or event; keeps a row well under
# SQLite's and PostgreSQL's comfortable row sizes and a snapshot load bounded.
MAX_VALUE_BYTES = 1024 * 1024

# Arrays and objects nested in one value: what every worker can decode. The decoder's own bound
# depends on the Python (3.11 counts the caller's frames against its recursion limit of 1,000;
# 3.12 and later allow about 10,000), and a worker decodes deeper in its stack than a client
# encodes, so a value near that bound could be stored and then never read. Half of 3.11's leaves
# room for the envelopes values travel in (a start input around its settings, say).
MAX_VALUE_NESTING = 500

# Flow IDs, step types, names: long enough for UUID-based compound IDs, short enough to index.
MAX_ID_LENGTH = 255

# Characters that IDs may not contain: '/' joins IDs into compound keys (idempotency keys),
# control characters and whitespace make IDs unreadable in logs and the CLI.
RESERVED_ID_CHARACTERS = "/"

# Characters that schema names (attributes, channels, streams and their maps) may not contain, on
# top of the IDs' rules: a map instance's lock and label is "Name[key]", so a plain attribute named
# "Cfg[v2]" could not be told from instance "v2" of a map "Cfg" (and could not be locked).
RESERVED_NAME_CHARACTERS = "[]"

# A stream's default capacity per flow; the oldest events are trimmed beyond it.
DEFAULT_STREAM_CAPACITY_BYTES = 10 * 1024 * 1024

# Step history events kept per flow; older ones are trimmed so history stays bounded.
MAX_HISTORY_EVENTS_PER_FLOW = 20_000

# Characters of an error's text kept (a history event's detail, a flow's error, the error a failure
# route is handed): enough for a message and the top of a traceback, while a handler raising a huge
# error (a whole response body) grows nothing by megabytes, nor makes the failure route's own
# writes, which often keep the error, too large to commit.
MAX_ERROR_TEXT_CHARS = 4000

# Worker-side errors (its own, not the handler's) in ending one attempt before it fails that
# attempt rather than hand it back again: an unstarted attempt handed back is run again under the
# same number (E3), so an error that recurs each time would otherwise repeat it without end, while
# one or two in a row (a lost connection) are worth a fresh try that consumes no retry.
MAX_WORKER_ERRORS_PER_ATTEMPT = 3

# Attempts whose worker-side errors a worker counts at once: more would mean a broken database or
# worker, where the counts matter less than the worker's memory staying bounded.
MAX_WORKER_ERROR_ENTRIES = 1000

# A counted attempt with no worker-side error for this long went to another worker (or ended
# there): a full count drops it for a new one. One handed back here is run again within a
# housekeeping or two (seconds), so its count is never this old while its error recurs.
WORKER_ERROR_STALE_SECONDS = 120.0

# Lease of a worker: a worker that has not renewed for this long is declared dead and its
# started attempts fail (unstarted ones are handed out again). 30 s matches Procrastinate.
DEFAULT_LEASE_TTL_SECONDS = 30.0

# A worker whose host's clock is further than this from the database server's says so at start:
# leases, deadlines and timers are wall-clock times each host writes and reads with its own clock,
# so a host that runs ahead declares the others' workers dead early (their started Steps fail as
# lost and run again) and fires timers early. A tenth of the default lease TTL.
CLOCK_SKEW_WARN_MS = 3000

# Longest WorkerOptions duration accepted (lease TTL, renewal, housekeeping, poll, shutdown grace):
# a day, far beyond any sensible setting; a lease expiry past it would overflow nothing, but a
# misplaced unit (ms for s) or an infinity is caught at once instead of when a worker starts.
MAX_OPTION_SECONDS = 24 * 3600

# Renewal interval; a third of the TTL so two missed renewals do not lose the lease.
DEFAULT_LEASE_RENEW_SECONDS = 10.0

# How often any worker scans for due timers, expired leases and timeouts when idle.
DEFAULT_HOUSEKEEPING_SECONDS = 1.0

# Flows whose due timers one housekeeping transaction fires: a few tens of ms of write lock on either
# backend, where a burst (approval deadlines that fell due while no worker ran) took seconds in one
# transaction, and a failed pass redoes only its own flows.
TIMERS_FIRED_PER_HOUSEKEEPING = 128

# Closed flows one housekeeping pass deletes under retention (WorkerOptions.closed_flow_retention_seconds):
# an agent session's rows (a message window, history, a stream of up to some MiB) take about a
# millisecond or a few to delete, so a pass holds the write lock for tens of ms at most, and a
# backlog (retention enabled on an old database) drains at this many per housekeeping interval.
CLOSED_FLOWS_DELETED_PER_HOUSEKEEPING = 32

# While a pass left closed flows past retention for later ones, a worker housekeeps again this soon:
# four passes a second of tens of ms each leave the write lock free most of the time and drain a
# backlog at about 128 flows a second (some 460,000 an hour), not 32 a housekeeping interval.
RETENTION_BACKLOG_HOUSEKEEPING_SECONDS = 0.25

# Longest closed-flow retention accepted: ten years, beyond any retention policy, while a duration
# given in ms instead of s (or an infinity) is refused; keep closed flows for ever with None.
MAX_RETENTION_SECONDS = 10 * 366 * 24 * 3600

# A worker's housekeeping fires timers only while fewer than TIMERS_FIRED_PER_HOUSEKEEPING tasks of
# its flow types are ready: claims take the oldest ready first, so a message that arrives during a
# burst waits behind at most that many, not behind the whole burst. Beyond that it still fires this
# many a pass, so ready work that never drains (a steady stream, lock-blocked tasks) delays timers
# but never starves them.
TIMERS_FIRED_WHILE_BACKLOGGED = 16

# While a pass left due timers for later ones, a worker housekeeps again this soon, not a whole
# interval on: that many ready tasks drain in about this long on either backend (a few hundred agent
# turns a second), and a pass that finds them still queued fires nothing at the cost of one short
# transaction, twenty a second at most.
TIMER_BURST_HOUSEKEEPING_SECONDS = 0.05

# A failed lease renewal (or registration after being declared dead) is tried again this soon, at
# most, rather than a whole renewal period later: the worker claims nothing until it succeeds.
RENEW_RETRY_SECONDS = 1.0

# How far the wall clock may move against the monotonic clock between two of a worker's polls and
# still count as drift; more is a step (NTP setting the time, a virtual machine resumed), after
# which the worker declares no other worker dead for one lease TTL (their renewals catch up).
CLOCK_STEP_SECONDS = 2.0

# How often a worker checks the database for work another process made (SQLite data_version).
DEFAULT_POLL_SECONDS = 0.02

# Failed polls in a row are retried after a pause that doubles from poll_seconds up to this: a
# database that keeps failing (a corrupt file, a full disk) is not hammered, nor its error logged,
# fifty times a second, and one back within a second is polled within a second.
POLL_RETRY_MAX_SECONDS = 1.0

# While a worker's polls or lease renewals keep failing, the error is logged with its traceback
# once, then once per this period: enough to see it goes on, not a log filled with one error.
FAILURE_LOG_SECONDS = 60.0

# Concurrent Step handlers per worker.
DEFAULT_MAX_CONCURRENT_TASKS = 64

# Most concurrent Step handlers a worker accepts: far more than one event loop runs well, and a
# claim's row limit (this times CLAIM_ROWS_PER_SLOT) stays well inside the 64-bit integers SQL's
# LIMIT takes; a "no limit" of sys.maxsize failed every poll with OverflowError, running nothing.
MAX_CONCURRENT_TASKS = 100_000

# Ready rows a claim reads per free slot: some are skipped (a lock they need is held, by a Step or
# by an earlier claim of the same call), so it reads more than it can take to still fill its slots.
CLAIM_ROWS_PER_SLOT = 4

# How long stop() lets started attempts finish before revoking them: a model or tool call of a few
# seconds completes, while a deploy's restart is not held up by one that runs for minutes.
DEFAULT_SHUTDOWN_GRACE_SECONDS = 10.0

# SQLite busy timeout: long enough for another process's group commit to finish.
SQLITE_BUSY_TIMEOUT_MS = 30_000
# How long a store opening a SQLite file waits for another store migrating it (SqliteStore's
# _begin_migration): a migration rewriting a large file holds the write lock for minutes.
SQLITE_MIGRATION_WAIT_SECONDS = 1800.0
# Between tries at putting a new file in WAL mode: stores opening it at once can get SQLITE_BUSY
# there without SQLite's busy handler waiting, and the one converting it is done within a few ms.
WAL_SWITCH_RETRY_SECONDS = 0.002
# An operation run on its event loop (SqliteStore._inline) must not block the loop waiting for
# SQLite's lock: it gives up at once and goes to the store's thread, which waits.
INLINE_BUSY_TIMEOUT_MS = 0
# With nothing queued for it, the store's thread holds its connection only briefly (handing out a
# finished batch's results, a check for other processes' commits): an operation about to run on its
# loop waits this long for it rather than hand off, which costs more than the wait.
INLINE_LOCK_WAIT_SECONDS = 0.002
# An operation that finds its loop busy while the store's thread is idle lets the ready callbacks
# run this many rounds before it hands off: they are mostly a few short wake-ups (an event flush
# that just ended), and a hand-off costs far more, besides the folds only an inline commit makes.
INLINE_YIELDS = 3

# After writing back to back for SQLITE_WRITER_BUSY_SECONDS, a process leaves the file's write lock
# free for SQLITE_WRITER_YIELD_SECONDS, so other processes waiting for it get in: a 5% gap at most.
SQLITE_WRITER_BUSY_SECONDS = 0.010
SQLITE_WRITER_YIELD_SECONDS = 0.0005

# The file beside an SQLite database whose flock its writers take turns through (_writer_turns):
# next to SQLite's own -wal and -shm files, where the process can already create files.
SQLITE_WRITER_TURN_SUFFIX = "-dexlock"
# How often an SQLite store's reads, and its -wal and -shm files, are checked against the files at
# their paths (SqliteStore._check_file): a stat each, while every write checks the database file.
SQLITE_FILE_CHECK_SECONDS = 1.0

# Most operations one group commit carries; bounds the latency one batch adds to its last op.
MAX_GROUP_COMMIT_OPS = 256

# Decoded shareable values kept per process (_codec.decode_value): enough for the message windows and
# chunks of many sessions at once. The byte bound (of the stored JSON) keeps a few large values from
# holding up to DECODED_VALUE_CACHE_ENTRIES MiB: decoded, 32 MiB of JSON is well under 100 MiB.
DECODED_VALUE_CACHE_ENTRIES = 8192
DECODED_VALUE_CACHE_BYTES = 32 * 1024 * 1024

# Attribute rows kept per store for the flows it used last (_attribute_cache): a turn's Steps read
# their session's message window from here instead of loading it again. A few hundred busy sessions
# per worker process, each a 64-message window of a few hundred bytes a message, fit many times over.
ATTRIBUTE_CACHE_FLOWS = 1024
ATTRIBUTE_CACHE_BYTES = 64 * 1024 * 1024

# Resolved options of movements kept per process (_scheduling.task_options). A movement's options
# can be unique to it (an agent tool Step loads its own call's record), so the cache must be bounded;
# a few thousand entries hold every Step type of many flow types with room to spare.
SCHEDULING_OPTIONS_CACHE_ENTRIES = 4096

# Flow types a client remembers by flow ID, so an RPC needs no read to find its handler: the
# active flows of a busy application; a miss costs one read.
CLIENT_FLOW_TYPE_CACHE_ENTRIES = 100_000

# A blocking Client's caller waits for its call in pieces of this long, so that a Ctrl-C no lock wait
# woke (one landing just before the wait blocked) reaches it within this long, not at the call's end;
# a call that ends sooner returns at once.
CLIENT_SIGNAL_CHECK_SECONDS = 0.1

# RPC optimistic validation: tries before RpcContentionError.
MAX_RPC_TRIES = 64

# Races an RPC loses before its next try runs the handler inside the transaction that holds the
# flow's write lock, which cannot lose: two, so that an uncontended RPC and one that lost once to a
# single other writer never hold the lock over a handler run, while writers of other clients and
# processes cannot make one lose 64 times in a row.
RPC_LOCKED_AFTER_LOST_RACES = 2

# Bare yields (asyncio.sleep(0)) a handler run inside that transaction may make: each is only
# resumed; one that yields more is polling something the transaction cannot wait for.
RPC_LOCKED_YIELDS = 100

# How long that transaction waits for the caller's event loop to run the handler, holding the
# flow's write lock (on SQLite the file's): the loop waits for this transaction, so it answers in
# well under a millisecond unless something blocks it; then the RPC goes back to racing.
RPC_LOCKED_LOOP_WAIT_SECONDS = 1.0

# Events a stream read, or flow IDs a search, returns when the caller names no limit: one page a UI can render.
DEFAULT_READ_LIMIT = 1000

# Largest limit a stream read or a search accepts: more than any read returns, and well inside the
# 64-bit integers SQL's LIMIT takes (a larger Python int failed the read with OverflowError).
MAX_READ_LIMIT = 10**9

# A stream long-poll waits at most this long for new events.
MAX_STREAM_WAIT_SECONDS = 60.0

# Printed events whose digests `dex-engine stream --follow` keeps, to find the first one a database
# crash lost: a crash loses the last moments of commits, far fewer events than this (~1 MB kept).
FOLLOW_REMEMBERED_EVENTS = 10_000

# How often a client's long-polling stream readers (all of them, in one statement) look for new
# events: a reader returns within about this long of an event's commit.
STREAM_WATCH_SECONDS = 0.02

# Longest timer and retry interval accepted: a year, far beyond any real wait.
MAX_TIMER_SECONDS = 366 * 24 * 3600

# Longest wait before a retry that a failed attempt's error may ask for (its retry_after_seconds, such
# as a provider's Retry-After): a day, past any rate limit's window. A longer one (milliseconds given
# as seconds, an HTTP date far off, an infinity) waits this long, still within the policy's total duration.
MAX_RETRY_AFTER_SECONDS = 24 * 3600

# History is trimmed every this many events of a flow, so a flow keeps between
# MAX_HISTORY_EVENTS_PER_FLOW and that plus this many events.
HISTORY_TRIM_CHECK_EVERY = 256
# The same on SQLite, whose trim walks a flow's whole chain of history batches (schema 7): a walk
# of up to about 20,000 events every this many keeps its cost per event small.
HISTORY_CHAIN_TRIM_EVERY = 4096

# search_flows with ActiveStepTypes reads the flows that have the Step through its index when there
# are at most this many; with more, it reads running flows in order and stops at its limit, which
# is then cheaper than sorting every match (e.g. all sessions idle in AwaitUserMessage).
ACTIVE_STEP_SEARCH_CANDIDATES = 2000
# With more, it reads the running flows in order as far as one per this many candidates, then
# whatever that window lacks from all the candidates, ordered by the database; the candidates are
# counted up to ACTIVE_STEP_SEARCH_COUNTED (the count reads an index; a larger count changes little).
ACTIVE_STEP_SEARCH_CANDIDATES_PER_FLOW_WALKED = 4
ACTIVE_STEP_SEARCH_COUNTED = 400_000
# On PostgreSQL the candidates' flows are looked up one by one up to this many, and the planner
# chooses beyond (see _active_step_flows_after).
ACTIVE_STEP_SEARCH_LOOKUPS_PG = 10_000

# Pure Executes (Step.pure_execute) one commit may run inside its own transaction: each runs on the
# event loop while the store's write lock is held, so a chain of them must stay short.
MAX_FOLDED_EXECUTES_PER_COMMIT = 4

# Task options shared between task rows (SQLite, _task_options): a store uses a task_options row it
# confirmed without writing it again for TASK_OPTIONS_REFRESH_MS, and housekeeping deletes a row
# only once it is unused for TASK_OPTIONS_KEEP_MS and no task names it. The keep time is many
# refresh periods, so a row a store may use unconfirmed is never deleted.
TASK_OPTIONS_REFRESH_MS = 60 * 60 * 1000
TASK_OPTIONS_KEEP_MS = 24 * 60 * 60 * 1000
# How often a store's housekeeping looks for unused task_options rows (they are few, and each look
# at one reads every task).
TASK_OPTIONS_COLLECT_MS = 60 * 60 * 1000
# Rows a store remembers as confirmed: every Step type of many flow types; a miss costs one upsert.
TASK_OPTIONS_CONFIRMED_ENTRIES = 4096

# Rows one multi-row statement writes or names: at most 6 parameters each, far below either
# backend's limit on parameters per statement.
ROWS_PER_STATEMENT = 200
# Channel instances an operation may have published to and still have only the waits naming them
# read (evaluate_waits); past it, every wait of the flow is read, in one statement as before.
MOST_PUBLISHED_INSTANCES_NAMED = 64

# The largest whole number either backend stores or takes as a parameter (signed 64 bits; SQLite's
# driver raises OverflowError past it): the bound of counts and sizes a Flow declares (a retry
# policy's max_attempts, a Stream's capacity), which are stored with tasks or bound to statements.
MAX_WHOLE_NUMBER = 2**63 - 1
# The largest channel message ID: both backends number messages with signed 64-bit integers, and
# SQLite cannot even be asked about a larger one (the driver raises OverflowError).
MAX_MESSAGE_ID = MAX_WHOLE_NUMBER

# Attempts still running that a worker stopping past its grace names in its warning, and attempts a
# housekeeping pass took back or timed out that its worker's warning names; the count says how
# many more, and one log line stays readable with hundreds of slots.
LATE_ATTEMPTS_NAMED = 10

# How much of a caller's value an error message shows by default: enough to recognise it, while a
# megabyte of text given by mistake does not become a megabyte of log line.
SHOWN_CHARS = 60

# Rounds of the PostgreSQL store's check at open for a transaction pooler in front of the server
# (_pg_store._refuse_transaction_pooling): one round misses such a pooler only when another client's
# transaction ends at the wrong moment (measured through PgBouncer with 4 busy clients: 2 opens in
# 30), and each round costs 5 short round trips.
POOLER_PROBE_ROUNDS = 3
