-- dex_engine schema, version 1. Times are milliseconds since the Unix epoch (UTC).

CREATE TABLE meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

CREATE TABLE flows (
    flow_id TEXT PRIMARY KEY,
    flow_type TEXT NOT NULL,
    status TEXT NOT NULL,               -- running, completed, failed, stopped
    input BLOB NOT NULL,
    output BLOB,
    error TEXT,
    config BLOB NOT NULL,
    version INTEGER NOT NULL,           -- bumped by every state change; RPC validation reads it
    completing INTEGER NOT NULL DEFAULT 0,  -- graceful_complete requested
    completion_output BLOB,
    history_seq INTEGER NOT NULL DEFAULT 0,  -- last history sequence of this flow
    created_at INTEGER NOT NULL,
    closed_at INTEGER
);
CREATE INDEX flows_type_status ON flows (flow_type, status);
CREATE INDEX flows_status ON flows (status, created_at);

CREATE TABLE step_counters (
    flow_id TEXT NOT NULL,
    step_type TEXT NOT NULL,
    n INTEGER NOT NULL,
    PRIMARY KEY (flow_id, step_type)
);

-- One row per scheduled Step execution until it ends.
CREATE TABLE tasks (
    task_id INTEGER PRIMARY KEY AUTOINCREMENT,
    flow_id TEXT NOT NULL,
    flow_type TEXT NOT NULL,
    step_type TEXT NOT NULL,
    step_execution_id TEXT NOT NULL,
    input BLOB NOT NULL,
    options BLOB NOT NULL,
    method TEXT NOT NULL,               -- wait_for, execute
    state TEXT NOT NULL,                -- ready, running, waiting
    attempt INTEGER NOT NULL,
    attempt_started INTEGER NOT NULL DEFAULT 0,
    any_started INTEGER NOT NULL DEFAULT 0,
    method_first_at INTEGER,            -- first claim of this method (retry total duration)
    run_at INTEGER NOT NULL,
    lease_owner TEXT,
    lease_epoch INTEGER NOT NULL DEFAULT 0,
    claimed_at INTEGER,
    deadline_at INTEGER,                -- earliest of method and heartbeat deadlines
    method_deadline_at INTEGER,
    checkpoint TEXT,
    snapshot BLOB,
    locks_held INTEGER NOT NULL DEFAULT 0,
    wait_spec BLOB,
    wait_registered_at INTEGER,
    timer_due_at INTEGER,
    timers_skipped INTEGER NOT NULL DEFAULT 0,
    wait_outcome BLOB,
    last_error BLOB,
    recovery_error BLOB,
    created_at INTEGER NOT NULL
);
-- Partial indexes: a task sits in only the index of its state, so a Step dirties few pages.
CREATE INDEX tasks_ready ON tasks (run_at) WHERE state = 'ready';
CREATE INDEX tasks_flow ON tasks (flow_id, step_type);
CREATE INDEX tasks_timer ON tasks (timer_due_at) WHERE state = 'waiting';
CREATE INDEX tasks_deadline ON tasks (deadline_at) WHERE state = 'running' AND deadline_at IS NOT NULL;

CREATE TABLE locks (
    flow_id TEXT NOT NULL,
    lock_name TEXT NOT NULL,
    task_id INTEGER NOT NULL,
    PRIMARY KEY (flow_id, lock_name)
);
CREATE INDEX locks_task ON locks (task_id);

CREATE TABLE attributes (
    flow_id TEXT NOT NULL,
    name TEXT NOT NULL,
    key TEXT NOT NULL,                  -- '' for a plain Attribute
    value BLOB NOT NULL,
    PRIMARY KEY (flow_id, name, key)
);

CREATE TABLE channel_messages (
    message_id INTEGER PRIMARY KEY AUTOINCREMENT,
    flow_id TEXT NOT NULL,
    channel TEXT NOT NULL,
    key TEXT NOT NULL,
    value BLOB NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE INDEX channel_queue ON channel_messages (flow_id, channel, key, message_id);

CREATE TABLE streams (
    flow_id TEXT NOT NULL,
    stream TEXT NOT NULL,
    next_seq INTEGER NOT NULL,
    first_seq INTEGER NOT NULL,
    total_bytes INTEGER NOT NULL,
    PRIMARY KEY (flow_id, stream)
);

CREATE TABLE stream_events (
    flow_id TEXT NOT NULL,
    stream TEXT NOT NULL,
    seq INTEGER NOT NULL,
    step_execution_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    value BLOB NOT NULL,
    PRIMARY KEY (flow_id, stream, seq)
);

CREATE TABLE history (
    flow_id TEXT NOT NULL,
    seq INTEGER NOT NULL,               -- per flow, from flows.history_seq
    step_type TEXT NOT NULL,
    step_execution_id TEXT NOT NULL,
    event_type TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    at INTEGER NOT NULL,
    detail TEXT NOT NULL,
    PRIMARY KEY (flow_id, seq)
) WITHOUT ROWID;

CREATE TABLE workers (
    worker_id TEXT PRIMARY KEY,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    started_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL
);
