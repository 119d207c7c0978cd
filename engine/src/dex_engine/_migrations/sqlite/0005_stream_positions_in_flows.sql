-- dex_engine schema for SQLite, version 5: each flow's stream positions move into its row.
--
-- An append reserved its sequences with an update of the stream's row in `streams`: a statement
-- and a page of that table in every commit that writes an event (most of an agent session's).
-- In the flow row, which those commits already rewrite (history, version), the positions are read
-- with the row and written with that update. JSON text: {"<stream>": [next_seq, first_seq,
-- total_bytes], ...}, as the table's columns were; NULL until the first event.

ALTER TABLE flows ADD COLUMN streams TEXT;

UPDATE flows SET streams = (
    SELECT json_group_object(s.stream, json_array(s.next_seq, s.first_seq, s.total_bytes))
    FROM streams s WHERE s.flow_id = flows.flow_id
) WHERE EXISTS (SELECT 1 FROM streams s WHERE s.flow_id = flows.flow_id);

DROP TABLE streams;
