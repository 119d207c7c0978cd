-- dex_engine schema for SQLite, version 3: each flow's Step execution counters move into its row.
--
-- A Step's execution ID `<StepType>-<n>` takes the next n of its type in the flow. Kept in a table
-- of their own, every new Step cost an upsert and a page of that table in its commit (about one in
-- twenty of a turn's statements and pages). In the flow row, which every commit that starts a Step
-- already rewrites (its history sequence and version), the counters are read with the row and
-- written with that update. JSON text: {"<StepType>": n, ...}; NULL until the first Step.

ALTER TABLE flows ADD COLUMN step_counters TEXT;

UPDATE flows SET step_counters = (
    SELECT json_group_object(c.step_type, c.n) FROM step_counters c WHERE c.flow_id = flows.flow_id
) WHERE EXISTS (SELECT 1 FROM step_counters c WHERE c.flow_id = flows.flow_id);

DROP TABLE step_counters;
