-- dex_engine schema for SQLite, version 8: closed flows by when they closed, for retention.
--
-- Housekeeping under WorkerOptions.closed_flow_retention_seconds deletes the flows closed longest
-- ago, a few a pass. Without an index it would read every flow each housekeeping interval, on every
-- worker, to find none due most of the time. Only closed flows are in it (running ones have no
-- closed_at), so a flow's start and its Steps' commits write nothing to it; its close writes once.

CREATE INDEX flows_closed ON flows (closed_at) WHERE closed_at IS NOT NULL;
