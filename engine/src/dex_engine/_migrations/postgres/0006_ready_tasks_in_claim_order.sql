-- dex_engine schema for PostgreSQL, version 6: the index on ready tasks in the order claims take them.
--
-- A claim takes the oldest ready tasks by (run_at, task_id), a few at a time. On run_at alone the
-- index left PostgreSQL to read and sort every ready task of the oldest run_at for each claim, and
-- a housekeeping pass that fires many timers (approval deadlines that fell due while no worker ran)
-- makes all of their tasks ready at one run_at: 5,000 of them took 18 s to be claimed once each,
-- every Step commit that claims for its freed slot sorting them all again. SQLite's index holds
-- the rowid (task_id) after run_at already.

DROP INDEX tasks_ready;
CREATE INDEX tasks_ready ON tasks (run_at, task_id) WHERE state = 'ready';
