-- dex_engine schema for PostgreSQL, version 4: a mark per lane that tells whether a commit happened.
--
-- When a connection drops after COMMIT was sent, the store must learn whether the transaction
-- committed. pg_xact_status alone cannot say: a server crash that loses a transaction's WAL also
-- loses its transaction ID, and after the restart the server hands that ID to a new transaction,
-- whose status the old one's would then appear to have. So each writing transaction also sets its
-- lane's mark to the lane's next sequence number; the mark is there exactly when the transaction
-- committed. One row per lane (a connection of one process), overwritten in place; rows of lanes
-- gone quiet are deleted when a store opens (_pg_store.COMMIT_MARK_RETENTION).

CREATE TABLE commit_marks (
    lane TEXT PRIMARY KEY,
    seq BIGINT NOT NULL,
    updated_at TIMESTAMPTZ NOT NULL
);
