-- dex_engine schema for SQLite, version 6: task options stored once per distinct value.
--
-- Every task row held its Step's options as JSON, about 700 bytes for an agent's Steps (the
-- attributes each method loads, retry policies), the same for every task of a Step type. That made
-- the tasks table several pages wide, and a commit that deletes one task and inserts the next
-- wrote about four of its pages plus the first page (its free list). A task row now holds
-- `#<digest>`, the key of the options' row here (rows written before this schema keep their JSON,
-- which readers still take): an agent turn writes about 15 pages fewer over its four commits.
--
-- `used_at`: when a store last confirmed the row in a commit that uses it; housekeeping deletes
-- rows unused for a day that no task names (_task_options).

CREATE TABLE task_options (
    digest BLOB PRIMARY KEY,
    options BLOB NOT NULL,
    used_at INTEGER NOT NULL
) WITHOUT ROWID;
