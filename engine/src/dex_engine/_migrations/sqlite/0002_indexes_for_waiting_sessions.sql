-- dex_engine schema for SQLite, version 2: indexes that keep a worker's housekeeping and the
-- search for waiting sessions independent of how many sessions wait.
--
-- Housekeeping looks for running tasks whose worker is gone and for claims a worker holds but lost
-- the reply to. Without an index on running tasks both read every task, and tasks grow with the
-- sessions waiting for a person or a timer: with 100,000 waiting, one pass took about 260 ms of
-- the store's write lock, every housekeeping interval, on every worker. Running tasks are those
-- attempts in flight, a few per worker slot, so this index stays small.

CREATE INDEX tasks_running ON tasks (lease_owner, claimed_at) WHERE state = 'running';

-- Sessions waiting for a person are found by their waiting Step's type (search_flows with
-- ActiveStepTypes). Without this index that search read every running flow and looked for the
-- Step in each: about 340 ms with 100,000 sessions on SQLite, on the store's one thread. Only
-- waiting tasks are indexed: they are the ones that stay; ready and running ones are few and
-- found through tasks_ready and tasks_running, and Steps handed straight to a worker never touch it.
CREATE INDEX tasks_waiting ON tasks (step_type, flow_id) WHERE state = 'waiting';
