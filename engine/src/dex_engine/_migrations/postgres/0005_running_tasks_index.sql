-- dex_engine schema for PostgreSQL, version 5: running tasks indexed by lease owner.
--
-- Housekeeping looks for running tasks whose worker is gone and for claims a worker holds but lost
-- the reply to. Without an index on running tasks both read every task (a sequential scan), and
-- tasks grow with the sessions waiting for a person or a timer: with 100,000 waiting, about 70 ms
-- each, every housekeeping interval, on every worker. Running tasks are the attempts in flight, a
-- few per worker slot, so this index stays small.

CREATE INDEX tasks_running ON tasks (lease_owner, claimed_at) WHERE state = 'running';
