-- dex_engine schema for SQLite, version 2: running tasks indexed by lease owner.
--
-- Housekeeping looks for running tasks whose worker is gone and for claims a worker holds but lost
-- the reply to. Without an index on running tasks both read every task, and tasks grow with the
-- sessions waiting for a person or a timer: with 100,000 waiting, one pass took about 260 ms of
-- the store's write lock, every housekeeping interval, on every worker. Running tasks are those
-- attempts in flight, a few per worker slot, so this index stays small.

CREATE INDEX tasks_running ON tasks (lease_owner, claimed_at) WHERE state = 'running';
