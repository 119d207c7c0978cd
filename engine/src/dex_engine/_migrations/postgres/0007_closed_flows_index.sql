-- dex_engine schema for PostgreSQL, version 7: closed flows by when they closed, for retention.
--
-- Housekeeping under WorkerOptions.closed_flow_retention_seconds deletes the flows closed longest
-- ago, a few a pass. Without an index it would read every flow (a sequential scan) each
-- housekeeping interval, on every worker, to find none due most of the time. Only closed flows are
-- in it (running ones have no closed_at), so a flow's start and its Steps' commits write nothing to
-- it; its close writes once. Built inside the migration's transaction (CREATE INDEX CONCURRENTLY
-- cannot be), which holds off writes to flows while it reads them: seconds for millions of flows.

CREATE INDEX flows_closed ON flows (closed_at) WHERE closed_at IS NOT NULL;
