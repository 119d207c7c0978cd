-- dex_engine schema for PostgreSQL, version 3: dex_commit_execute works on a batch as a whole.
--
-- Version 2's function ran four to six statements per operation, and the server's cost per
-- statement (executor start and end, a plan chosen anew for some of them) was most of its CPU per
-- Step. dex_commit_execute_sets takes the same arguments and returns the same rows (see 0002), but
-- runs about twelve statements per batch whatever its size: lock and check every lease, write every
-- attribute, delete every finished task, insert every next task with its counters, complete and
-- close flows, and write the history.
--
-- dex_commit_execute now picks one of the two. A lone operation takes version 2's function, kept
-- as dex_commit_execute_each, which runs fewer statements for it. So does a batch in which two
-- operations belong to one flow: there each must see the one before it (the next Step's snapshot
-- after the first must not hold the second's writes), which only running them in turn gives.
--
-- Every statement here is a lookup or a write by key whose plan does not depend on the values: the
-- functions always run generic plans, never planning again per call.

ALTER FUNCTION dex_commit_execute(JSONB, JSONB, JSONB, BIGINT, INTEGER, INTEGER) RENAME TO dex_commit_execute_each;
ALTER FUNCTION dex_commit_execute_each(JSONB, JSONB, JSONB, BIGINT, INTEGER, INTEGER)
    SET plan_cache_mode = force_generic_plan;

-- E15: the attributes a method loads (LoadSpec as JSON), in the snapshot format of
-- _transitions._attempt_start: [[name, key, value], ...].
CREATE FUNCTION dex_load_snapshot(p_flow TEXT, p_spec JSONB) RETURNS BYTEA
LANGUAGE sql STABLE AS $$
    SELECT convert_to('[' || coalesce(string_agg(
               '[' || to_json(s.name)::text || ',' || to_json(s.key)::text || ',' || convert_from(s.value, 'UTF8')
               || ']', ','), '') || ']', 'UTF8')
      FROM (
          SELECT a.name, a.key, a.value FROM attributes a
           WHERE a.flow_id = p_flow AND coalesce(p_spec ->> 'mode', 'all') = 'all'
          UNION ALL
          SELECT a.name, a.key, a.value FROM attributes a
           WHERE a.flow_id = p_flow AND p_spec ->> 'mode' = 'only'
             AND a.name IN (SELECT jsonb_array_elements_text(p_spec -> 'names'))
          UNION ALL
          SELECT a.name, a.key, a.value FROM attributes a
            JOIN jsonb_array_elements(p_spec -> 'instances') e ON a.name = e ->> 0 AND a.key = e ->> 1
           WHERE a.flow_id = p_flow AND p_spec ->> 'mode' = 'only'
      ) s
$$;

CREATE FUNCTION dex_commit_execute_sets(p_ops JSONB, p_attrs JSONB, p_moves JSONB, p_now BIGINT,
                                        trim_every INTEGER, keep_events INTEGER)
RETURNS TABLE (r_idx INTEGER, r_kind TEXT, r_task BIGINT, r_seid TEXT, r_async BOOLEAN, r_snapshot BYTEA)
LANGUAGE plpgsql
-- A batch is at most MAX_BATCH_OPS operations: every join below is a few lookups by key, which
-- nested loops over the indexes do best however the tables grow (the planner cannot see how few
-- rows an unnest of a parameter gives).
SET plan_cache_mode = force_generic_plan SET enable_hashjoin = off SET enable_mergejoin = off SET enable_seqscan = off
AS $$
DECLARE
    -- The operations, attribute writes and movements, one array per field (see 0002), and the
    -- operation that owns each attribute write (a_op) and each movement (m_op).
    o_flow TEXT[];
    o_task BIGINT[];
    o_epoch BIGINT[];
    o_worker TEXT[];
    o_step_type TEXT[];
    o_seid TEXT[];
    o_attempt INTEGER[];
    o_kind TEXT[];
    o_release_locks BOOLEAN[];
    o_graceful BOOLEAN[];
    o_output BYTEA[];
    o_attr_end INTEGER[];
    o_move_end INTEGER[];
    a_op INTEGER[];
    a_name TEXT[];
    a_key TEXT[];
    a_value BYTEA[];
    m_op INTEGER[];
    m_step_type TEXT[];
    m_input BYTEA[];
    m_options BYTEA[];
    m_options_async BYTEA[];
    m_method TEXT[];
    m_handoff BOOLEAN[];
    m_deadline BIGINT[];
    m_method_deadline BIGINT[];
    m_load JSONB[];
    v_check TEXT[];          -- per operation: 'ok', 'stale' or 'inactive'
    v_status TEXT[];         -- per operation: its flow's status (NULL when its task is gone)
    v_async BOOLEAN[];       -- per operation: its flow's config makes Steps ASYNC by default (E16)
    v_completing BOOLEAN[];  -- per operation: its flow was completing already
    v_flow_type TEXT[];
    v_closed TEXT[];         -- flows this batch closed
    v_notify BOOLEAN;        -- a Step was inserted ready: wake the workers
    t_k INTEGER[];           -- per inserted task, in movement order: its movement, ID, execution ID, ...
    t_task BIGINT[];
    t_seid TEXT[];
    t_async BOOLEAN[];
    t_snapshot BYTEA[];
    t_flow TEXT[];
    t_step_type TEXT[];
    i INTEGER;
    j INTEGER;
BEGIN
    SELECT array_agg(e ->> 0 ORDER BY n), array_agg((e ->> 1)::BIGINT ORDER BY n),
           array_agg((e ->> 2)::BIGINT ORDER BY n), array_agg(e ->> 3 ORDER BY n), array_agg(e ->> 4 ORDER BY n),
           array_agg(e ->> 5 ORDER BY n), array_agg((e ->> 6)::INTEGER ORDER BY n), array_agg(e ->> 7 ORDER BY n),
           array_agg((e ->> 8)::BOOLEAN ORDER BY n), array_agg((e ->> 9)::BOOLEAN ORDER BY n),
           array_agg(convert_to(e ->> 10, 'UTF8') ORDER BY n), array_agg((e ->> 11)::INTEGER ORDER BY n),
           array_agg((e ->> 12)::INTEGER ORDER BY n)
      INTO o_flow, o_task, o_epoch, o_worker, o_step_type, o_seid, o_attempt, o_kind, o_release_locks,
           o_graceful, o_output, o_attr_end, o_move_end
      FROM jsonb_array_elements(p_ops) WITH ORDINALITY AS x (e, n);
    IF jsonb_array_length(p_attrs) > 0 THEN
        SELECT array_agg(e ->> 0 ORDER BY n), array_agg(e ->> 1 ORDER BY n),
               array_agg(convert_to(e ->> 2, 'UTF8') ORDER BY n)
          INTO a_name, a_key, a_value
          FROM jsonb_array_elements(p_attrs) WITH ORDINALITY AS x (e, n);
    END IF;
    IF jsonb_array_length(p_moves) > 0 THEN
        SELECT array_agg(e ->> 0 ORDER BY n), array_agg(convert_to(e ->> 1, 'UTF8') ORDER BY n),
               array_agg(convert_to(e ->> 2, 'UTF8') ORDER BY n), array_agg(convert_to(e ->> 3, 'UTF8') ORDER BY n),
               array_agg(e ->> 4 ORDER BY n), array_agg((e ->> 5)::BOOLEAN ORDER BY n),
               array_agg((e ->> 6)::BIGINT ORDER BY n), array_agg((e ->> 7)::BIGINT ORDER BY n),
               array_agg(CASE WHEN jsonb_typeof(e -> 8) = 'object' THEN e -> 8 END ORDER BY n)
          INTO m_step_type, m_input, m_options, m_options_async, m_method, m_handoff, m_deadline,
               m_method_deadline, m_load
          FROM jsonb_array_elements(p_moves) WITH ORDINALITY AS x (e, n);
    END IF;
    FOR i IN 1 .. array_length(o_flow, 1) LOOP
        FOR j IN coalesce(o_attr_end[i - 1], 0) + 1 .. o_attr_end[i] LOOP
            a_op[j] := i;
        END LOOP;
        FOR j IN coalesce(o_move_end[i - 1], 0) + 1 .. o_move_end[i] LOOP
            m_op[j] := i;
        END LOOP;
    END LOOP;

    -- E2: every operation's flow row, then its task row, locked in the operations' order (the
    -- client sorts them by flow ID, as every other transaction locks flows); then the leases.
    WITH locked AS MATERIALIZED (
        SELECT o.i, t.state, t.lease_epoch, f.status, f.config, f.completing, f.flow_type
          FROM unnest(o_flow, o_task) WITH ORDINALITY AS o (flow, task, i)
          JOIN flows f ON f.flow_id = o.flow
          JOIN tasks t ON t.task_id = o.task AND t.flow_id = o.flow
         ORDER BY o.i
           FOR UPDATE OF f, t
    )
    SELECT array_agg(CASE WHEN l.i IS NULL OR l.state <> 'running' OR l.lease_epoch <> o.epoch THEN 'stale'
                          WHEN l.status <> 'running' THEN 'inactive' ELSE 'ok' END ORDER BY o.i),
           array_agg(l.status ORDER BY o.i),
           array_agg(coalesce(convert_from(l.config, 'UTF8')::jsonb ->> 'default_step_durability' = 'ASYNC', FALSE)
                     ORDER BY o.i),
           array_agg(coalesce(l.completing <> 0, FALSE) ORDER BY o.i),
           array_agg(l.flow_type ORDER BY o.i)
      INTO v_check, v_status, v_async, v_completing, v_flow_type
      FROM unnest(o_epoch) WITH ORDINALITY AS o (epoch, i) LEFT JOIN locked l ON l.i = o.i;

    RETURN QUERY SELECT c.n::INTEGER, c.chk, NULL::BIGINT, c.status, NULL::BOOLEAN, NULL::BYTEA
                   FROM unnest(v_check, v_status) WITH ORDINALITY AS c (chk, status, n)
                  WHERE c.chk <> 'ok';
    IF NOT 'ok' = ANY (v_check) THEN
        RETURN;
    END IF;

    IF a_op IS NOT NULL THEN
        WITH w AS (
            SELECT o_flow[x.op] AS flow, x.name, x.key, x.value
              FROM unnest(a_op, a_name, a_key, a_value) AS x (op, name, key, value)
             WHERE v_check[x.op] = 'ok'
        ), gone AS (
            DELETE FROM attributes a USING w
             WHERE w.value IS NULL AND a.flow_id = w.flow AND a.name = w.name AND a.key = w.key
        )
        INSERT INTO attributes (flow_id, name, key, value)
        SELECT w.flow, w.name, w.key, w.value FROM w WHERE w.value IS NOT NULL
        ON CONFLICT (flow_id, name, key) DO UPDATE SET value = excluded.value;
    END IF;

    DELETE FROM locks WHERE task_id = ANY (
        SELECT o.task FROM unnest(o_task, o_release_locks, v_check) AS o (task, release, chk)
         WHERE o.chk = 'ok' AND o.release);
    DELETE FROM tasks WHERE task_id = ANY (
        SELECT o.task FROM unnest(o_task, v_check) AS o (task, chk) WHERE o.chk = 'ok');

    -- The next Steps: execution IDs <StepType>-<n>, n counted per flow and Step type; handed to
    -- the committing worker already claimed (with the snapshot its method loads), or ready.
    IF m_op IS NOT NULL THEN
        WITH m AS MATERIALIZED (
            SELECT mv.*, o_flow[mv.op] AS flow,
                   row_number() OVER (PARTITION BY o_flow[mv.op], mv.step_type ORDER BY mv.k) AS nth,
                   count(*) OVER (PARTITION BY o_flow[mv.op], mv.step_type) AS per_type,
                   CASE WHEN mv.options_async IS NOT NULL THEN v_async[mv.op] END AS is_async,
                   CASE WHEN mv.handoff AND mv.load IS NOT NULL
                        THEN dex_load_snapshot(o_flow[mv.op], mv.load) END AS snap
              FROM unnest(m_op, m_step_type, m_input, m_options, m_options_async, m_method, m_handoff, m_deadline,
                          m_method_deadline, m_load)
                   WITH ORDINALITY AS mv (op, step_type, input, options, options_async, method, handoff, deadline,
                                          method_deadline, load, k)
             WHERE v_check[mv.op] = 'ok'
        ), counted AS (
            INSERT INTO step_counters AS sc (flow_id, step_type, n)
            SELECT DISTINCT m.flow, m.step_type, m.per_type FROM m
            ON CONFLICT (flow_id, step_type) DO UPDATE SET n = sc.n + excluded.n
            RETURNING sc.flow_id, sc.step_type, sc.n
        ), planned AS MATERIALIZED (
            SELECT m.*, m.step_type || '-' || (c.n - m.per_type + m.nth) AS seid
              FROM m JOIN counted c ON c.flow_id = m.flow AND c.step_type = m.step_type
        ), inserted AS (
            INSERT INTO tasks (flow_id, flow_type, step_type, step_execution_id, input, options, method, state,
                               attempt, run_at, created_at, lease_owner, lease_epoch, claimed_at, method_first_at,
                               deadline_at, method_deadline_at, snapshot)
            SELECT p.flow, v_flow_type[p.op], p.step_type, p.seid, p.input,
                   CASE WHEN p.is_async THEN p.options_async ELSE p.options END, p.method,
                   CASE WHEN p.handoff THEN 'running' ELSE 'ready' END, 1, p_now, p_now,
                   CASE WHEN p.handoff THEN o_worker[p.op] END, CASE WHEN p.handoff THEN 1 ELSE 0 END,
                   CASE WHEN p.handoff THEN p_now END, CASE WHEN p.handoff THEN p_now END,
                   p.deadline, p.method_deadline, p.snap
              FROM planned p
             ORDER BY p.k
            RETURNING task_id, flow_id, step_execution_id
        )
        SELECT array_agg(p.k ORDER BY p.k), array_agg(t.task_id ORDER BY p.k), array_agg(p.seid ORDER BY p.k),
               array_agg(p.is_async ORDER BY p.k), array_agg(p.snap ORDER BY p.k), array_agg(p.flow ORDER BY p.k),
               array_agg(p.step_type ORDER BY p.k), bool_or(NOT p.handoff)
          INTO t_k, t_task, t_seid, t_async, t_snapshot, t_flow, t_step_type, v_notify
          FROM planned p JOIN inserted t ON t.flow_id = p.flow AND t.step_execution_id = p.seid;

        RETURN QUERY SELECT t.k::INTEGER, 'task'::TEXT, t.task, t.seid, t.is_async, t.snap
                       FROM unnest(t_k, t_task, t_seid, t_async, t_snapshot) AS t (k, task, seid, is_async, snap);
    END IF;

    UPDATE flows f SET completing = 1, completion_output = o.output
      FROM unnest(o_flow, o_output, o_graceful, v_check) AS o (flow, output, graceful, chk)
     WHERE o.chk = 'ok' AND o.graceful AND f.flow_id = o.flow;
    -- E12: a completing flow closes once no Step is left.
    WITH closed AS (
        UPDATE flows f SET status = 'completed', output = f.completion_output, error = NULL, closed_at = p_now,
                           version = f.version + 1
          FROM unnest(o_flow, o_graceful, v_completing, v_check) AS o (flow, graceful, completing, chk)
         WHERE o.chk = 'ok' AND (o.completing OR o.graceful) AND f.flow_id = o.flow
           AND NOT EXISTS (SELECT 1 FROM tasks t WHERE t.flow_id = o.flow)
        RETURNING f.flow_id
    )
    SELECT array_agg(closed.flow_id) INTO v_closed FROM closed;

    -- History (E13), as _transitions.flush_history: per flow, the Execute's completion, the Steps
    -- it scheduled and the close, numbered from the flow's sequence, which also bumps the version
    -- RPCs validate against; trimmed when the sequence crosses a multiple of trim_every.
    WITH ev AS (
        SELECT o.flow, 0 AS grp, 0::BIGINT AS k, o.step_type, o.seid, 'execute_completed'::TEXT AS event, o.attempt,
               o.kind AS detail
          FROM unnest(o_flow, o_step_type, o_seid, o_attempt, o_kind, v_check)
               AS o (flow, step_type, seid, attempt, kind, chk)
         WHERE o.chk = 'ok'
        UNION ALL
        SELECT s.flow, 1, s.k, s.step_type, s.seid, 'step_scheduled', 0, ''
          FROM unnest(t_flow, t_k, t_step_type, t_seid) AS s (flow, k, step_type, seid)
        UNION ALL
        SELECT c.flow, 2, 0, '', '', 'flow_closed', 0, 'completed' FROM unnest(v_closed) AS c (flow)
    ), numbered AS MATERIALIZED (
        SELECT ev.*, row_number() OVER (PARTITION BY ev.flow ORDER BY ev.grp, ev.k) AS ord,
               count(*) OVER (PARTITION BY ev.flow) AS total
          FROM ev
    ), f AS (
        UPDATE flows SET history_seq = flows.history_seq + t.total, version = flows.version + 1
          FROM (SELECT DISTINCT numbered.flow, numbered.total FROM numbered) t
         WHERE flows.flow_id = t.flow
        RETURNING flows.flow_id, flows.history_seq, t.total
    ), trimmed AS (
        DELETE FROM history h USING f
         WHERE h.flow_id = f.flow_id AND mod(f.history_seq, trim_every) < f.total
           AND h.seq <= f.history_seq - keep_events
    )
    INSERT INTO history (flow_id, seq, step_type, step_execution_id, event_type, attempt, at, detail)
    SELECT n.flow, f.history_seq - f.total + n.ord, n.step_type, n.seid, n.event, n.attempt, p_now, n.detail
      FROM numbered n JOIN f ON f.flow_id = n.flow;

    IF v_notify THEN
        PERFORM pg_notify('dex_engine', '');
    END IF;
END
$$;

CREATE FUNCTION dex_commit_execute(p_ops JSONB, p_attrs JSONB, p_moves JSONB, p_now BIGINT,
                                   trim_every INTEGER, keep_events INTEGER)
RETURNS TABLE (r_idx INTEGER, r_kind TEXT, r_task BIGINT, r_seid TEXT, r_async BOOLEAN, r_snapshot BYTEA)
LANGUAGE plpgsql AS $$
BEGIN
    IF (SELECT count(*) > 1 AND count(DISTINCT e ->> 0) = count(*) FROM jsonb_array_elements(p_ops) e) THEN
        RETURN QUERY SELECT * FROM dex_commit_execute_sets(p_ops, p_attrs, p_moves, p_now, trim_every, keep_events);
    ELSE
        RETURN QUERY SELECT * FROM dex_commit_execute_each(p_ops, p_attrs, p_moves, p_now, trim_every, keep_events);
    END IF;
END
$$;
