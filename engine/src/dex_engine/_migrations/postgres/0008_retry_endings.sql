-- dex_engine schema for PostgreSQL, version 8: an RPC's retry ending reaches an attempt running at its commit.
--
-- RPCResult.ending_retry_waits ends the executions that wait for a retry at the RPC's commit. An
-- execution whose attempt was running then (cancel_turn while a tool ran) fails later, and its retry
-- would wait as long as its error asked (an hour, for a rate limit): retry_ending keeps the RPC's
-- ending_reason on it, and a failure that would retry ends the execution with it instead. NULL: the
-- retry policy decides, as before.

ALTER TABLE tasks ADD COLUMN retry_ending TEXT;
