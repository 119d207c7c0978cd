-- dex_engine schema for SQLite, version 4: fewer b-tree pages written per commit.
--
-- Every page a commit changes is written to the WAL and fsynced with it; a sequential agent turn
-- wrote about 87 pages over its four commits, against a bare commit's one or two.
--
-- Waiting tasks without a timer (a session waiting for its next message, a turn for its tool
-- results) were all in the timer index, each wait one insert into it and one delete: 4 pages a
-- turn. Only waits with a timer go in it now; every query of it asks for a due time, which implies
-- one (next_due says so explicitly, so that SQLite sees the index applies).

DROP INDEX tasks_timer;
CREATE INDEX tasks_timer ON tasks (timer_due_at) WHERE state = 'waiting' AND timer_due_at IS NOT NULL;

-- Running tasks were in two indexes, one by worker and claim time (lost claims, dead workers'
-- attempts) and one by deadline (timeouts, the next due time): 8 pages a turn. Running tasks are
-- the attempts in flight, a few per worker slot, so one index of them, by deadline, serves both:
-- the worker and claim lookups read it whole, which stays small.

DROP INDEX tasks_deadline;
DROP INDEX tasks_running;
CREATE INDEX tasks_running ON tasks (deadline_at) WHERE state = 'running';

-- Attributes are read and written by (flow, name, key) only: keyed by that alone, a flow's rows
-- sit together and a write changes one b-tree instead of the table and its key index.

CREATE TABLE attributes_by_key (
    flow_id TEXT NOT NULL,
    name TEXT NOT NULL,
    key TEXT NOT NULL,
    value BLOB NOT NULL,
    PRIMARY KEY (flow_id, name, key)
) WITHOUT ROWID;
INSERT INTO attributes_by_key (flow_id, name, key, value) SELECT flow_id, name, key, value FROM attributes;
DROP TABLE attributes;
ALTER TABLE attributes_by_key RENAME TO attributes;
