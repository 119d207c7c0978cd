-- dex_engine schema for PostgreSQL, version 1 (the same tables as sqlite/0001_initial.sql).
-- Times are milliseconds since the Unix epoch (UTC).

CREATE TABLE meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

CREATE TABLE flows (
    flow_id TEXT PRIMARY KEY,
    flow_type TEXT NOT NULL,
    status TEXT NOT NULL,
    input BYTEA NOT NULL,
    output BYTEA,
    error TEXT,
    config BYTEA NOT NULL,
    version BIGINT NOT NULL,
    completing INTEGER NOT NULL DEFAULT 0,
    completion_output BYTEA,
    history_seq BIGINT NOT NULL DEFAULT 0,
    created_at BIGINT NOT NULL,
    closed_at BIGINT
);
CREATE INDEX flows_type_status ON flows (flow_type, status);
CREATE INDEX flows_status ON flows (status, created_at);

CREATE TABLE step_counters (
    flow_id TEXT NOT NULL,
    step_type TEXT NOT NULL,
    n BIGINT NOT NULL,
    PRIMARY KEY (flow_id, step_type)
);

CREATE TABLE tasks (
    task_id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    flow_id TEXT NOT NULL,
    flow_type TEXT NOT NULL,
    step_type TEXT NOT NULL,
    step_execution_id TEXT NOT NULL,
    input BYTEA NOT NULL,
    options BYTEA NOT NULL,
    method TEXT NOT NULL,
    state TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    attempt_started INTEGER NOT NULL DEFAULT 0,
    any_started INTEGER NOT NULL DEFAULT 0,
    method_first_at BIGINT,
    run_at BIGINT NOT NULL,
    lease_owner TEXT,
    lease_epoch BIGINT NOT NULL DEFAULT 0,
    claimed_at BIGINT,
    deadline_at BIGINT,
    method_deadline_at BIGINT,
    checkpoint TEXT,
    snapshot BYTEA,
    locks_held INTEGER NOT NULL DEFAULT 0,
    wait_spec BYTEA,
    wait_registered_at BIGINT,
    timer_due_at BIGINT,
    timers_skipped INTEGER NOT NULL DEFAULT 0,
    wait_outcome BYTEA,
    last_error BYTEA,
    recovery_error BYTEA,
    created_at BIGINT NOT NULL
);
CREATE INDEX tasks_ready ON tasks (run_at) WHERE state = 'ready';
CREATE INDEX tasks_flow ON tasks (flow_id, step_type);
CREATE INDEX tasks_timer ON tasks (timer_due_at) WHERE state = 'waiting';
CREATE INDEX tasks_deadline ON tasks (deadline_at) WHERE state = 'running' AND deadline_at IS NOT NULL;

CREATE TABLE locks (
    flow_id TEXT NOT NULL,
    lock_name TEXT NOT NULL,
    task_id BIGINT NOT NULL,
    PRIMARY KEY (flow_id, lock_name)
);
CREATE INDEX locks_task ON locks (task_id);

CREATE TABLE attributes (
    flow_id TEXT NOT NULL,
    name TEXT NOT NULL,
    key TEXT NOT NULL,
    value BYTEA NOT NULL,
    PRIMARY KEY (flow_id, name, key)
);

CREATE TABLE channel_messages (
    message_id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    flow_id TEXT NOT NULL,
    channel TEXT NOT NULL,
    key TEXT NOT NULL,
    value BYTEA NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE INDEX channel_queue ON channel_messages (flow_id, channel, key, message_id);

CREATE TABLE streams (
    flow_id TEXT NOT NULL,
    stream TEXT NOT NULL,
    next_seq BIGINT NOT NULL,
    first_seq BIGINT NOT NULL,
    total_bytes BIGINT NOT NULL,
    PRIMARY KEY (flow_id, stream)
);

CREATE TABLE stream_events (
    flow_id TEXT NOT NULL,
    stream TEXT NOT NULL,
    seq BIGINT NOT NULL,
    step_execution_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    value BYTEA NOT NULL,
    PRIMARY KEY (flow_id, stream, seq)
);

CREATE TABLE history (
    flow_id TEXT NOT NULL,
    seq BIGINT NOT NULL,
    step_type TEXT NOT NULL,
    step_execution_id TEXT NOT NULL,
    event_type TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    at BIGINT NOT NULL,
    detail TEXT NOT NULL,
    PRIMARY KEY (flow_id, seq)
);

CREATE TABLE workers (
    worker_id TEXT PRIMARY KEY,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    started_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL
)
