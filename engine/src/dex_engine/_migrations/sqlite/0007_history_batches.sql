-- dex_engine schema for SQLite, version 7: a commit's history is one row at the end of one b-tree.
--
-- History keyed by (flow, sequence) puts each flow's new events in the middle of the b-tree, after
-- its own older ones and before the next flow's. There SQLite keeps pages full, so most inserts
-- rebalanced a full page with its neighbours: a commit wrote about 2 leaves and half an interior
-- page of history (9.5 of a sequential agent turn's 60 pages). Keyed by a number that only grows,
-- every commit's history goes to the last leaf: about 1 page a commit.
--
-- A flow finds its batches through a chain: flows.history_head names its newest batch (set by the
-- update of the flow row that every commit with history makes anyway) and each batch the one
-- before it (prev), so no index by flow is written. Readers walk back from the head as far as they
-- need; trimming walks the whole chain, so it runs in larger steps than PostgreSQL's.

CREATE TABLE history_batches (
    batch_id INTEGER PRIMARY KEY,       -- grows with every commit: new rows go to the b-tree's end
    flow_id TEXT NOT NULL,
    first_seq INTEGER NOT NULL,         -- the sequence numbers of its events, from flows.history_seq
    last_seq INTEGER NOT NULL,
    prev INTEGER,                       -- the flow's batch before this one (NULL: none is kept)
    -- JSON array of [step_type, step_execution_id, event_type, attempt, at, detail], in order
    events BLOB NOT NULL
);

ALTER TABLE flows ADD COLUMN history_head INTEGER;

-- Each stored event becomes a batch of its own, in (flow, sequence) order, chained.
INSERT INTO history_batches (flow_id, first_seq, last_seq, prev, events)
SELECT flow_id, seq, seq, NULL,
       CAST(json_array(json_array(step_type, step_execution_id, event_type, attempt, at, detail)) AS BLOB)
FROM history ORDER BY flow_id, seq;

UPDATE history_batches SET prev = chained.prev
FROM (SELECT batch_id, LAG(batch_id) OVER (PARTITION BY flow_id ORDER BY first_seq) AS prev
      FROM history_batches) AS chained
WHERE chained.batch_id = history_batches.batch_id;

UPDATE flows SET history_head = newest.batch_id
FROM (SELECT flow_id, MAX(batch_id) AS batch_id FROM history_batches GROUP BY flow_id) AS newest
WHERE newest.flow_id = flows.flow_id;

DROP TABLE history;

-- The events one per row, as schema 6 stored them, for reading by hand and by tests (the engine
-- reads the batches). A view changes nothing a commit writes.
CREATE VIEW history (flow_id, seq, step_type, step_execution_id, event_type, attempt, at, detail) AS
SELECT b.flow_id, b.first_seq + e.key, json_extract(e.value, '$[0]'), json_extract(e.value, '$[1]'),
       json_extract(e.value, '$[2]'), json_extract(e.value, '$[3]'), json_extract(e.value, '$[4]'),
       json_extract(e.value, '$[5]')
FROM history_batches b, json_each(b.events) e;
