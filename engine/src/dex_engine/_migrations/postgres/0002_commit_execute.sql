-- dex_engine schema for PostgreSQL, version 2: the commits of a batch of Executes in one call.
--
-- dex_commit_execute does, for each operation i of a group commit, what _transitions.commit_execute
-- does for the shapes the PostgreSQL store sends it (attribute writes, no channel or stream writes,
-- no cancellations; movements, dead_end or graceful_complete): check the lease under the flow's row
-- lock (E2), write the attributes, release the method's locks, delete the task, insert the next
-- tasks (handed to the committing worker, already claimed, or ready), mark and attempt completion,
-- and write the history. One statement and one reply per batch instead of about four per Step.
--
-- The batch comes as three JSON arrays (one parameter each, which the client encodes far faster
-- than it binds arrays of arrays): p_ops, one entry per operation i, [flow, task, epoch, worker,
-- step type, execution ID, attempt, decision kind, release locks, graceful, completion output,
-- attribute end, movement end]; p_attrs [name, key, value or null to delete]; p_moves [step type,
-- input, options, options if ASYNC, method, handoff, deadline, method deadline, load]. Attribute
-- writes and movements are flattened: operation i owns attribute writes attribute_end[i-1]+1 ..
-- attribute_end[i], and movements likewise. Byte strings (values, inputs, options, outputs) are
-- UTF-8 JSON, sent as JSON strings. A movement whose durability comes from the flow config has
-- both variants of its options (SYNC, ASYNC); the flow's config picks one. Its load is the
-- LoadSpec of a handed-off movement whose method loads attributes, else null.
--
-- Returns one row per rejected operation (r_kind 'stale': the attempt no longer owns its task;
-- 'inactive': the flow is not running, r_seid holds its status), which then changed nothing, and
-- one row per inserted task (r_kind 'task', r_idx the movement's index) with its ID, execution ID,
-- whether its durability came out ASYNC (NULL when the movement fixed it) and its snapshot.

CREATE FUNCTION dex_commit_execute(p_ops JSONB, p_attrs JSONB, p_moves JSONB, p_now BIGINT,
                                   trim_every INTEGER, keep_events INTEGER)
RETURNS TABLE (r_idx INTEGER, r_kind TEXT, r_task BIGINT, r_seid TEXT, r_async BOOLEAN, r_snapshot BYTEA)
LANGUAGE plpgsql AS $$
DECLARE
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
    a_name TEXT[];
    a_key TEXT[];
    a_value BYTEA[];
    m_step_type TEXT[];
    m_input BYTEA[];
    m_options BYTEA[];
    m_options_async BYTEA[];
    m_method TEXT[];
    m_handoff BOOLEAN[];
    m_deadline BIGINT[];
    m_method_deadline BIGINT[];
    m_load JSONB[];
    i INTEGER;
    j INTEGER;
    k INTEGER;
    a_from INTEGER := 1;
    m_from INTEGER := 1;
    v_flow TEXT;
    v_now BIGINT;
    v_state TEXT;
    v_epoch BIGINT;
    v_status TEXT;
    v_config BYTEA;
    v_completing INTEGER;
    v_flow_type TEXT;
    v_async BOOLEAN;
    v_options BYTEA;
    v_seid TEXT;
    v_task BIGINT;
    v_snapshot BYTEA;
    v_spec JSONB;
    v_count INTEGER;
    v_notify BOOLEAN := FALSE;
    h_step TEXT[];
    h_seid TEXT[];
    h_event TEXT[];
    h_attempt INTEGER[];
    h_detail TEXT[];
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
    v_now := p_now;
    FOR i IN 1 .. coalesce(array_length(o_flow, 1), 0) LOOP
        v_flow := o_flow[i];
        -- E2: the flow's row lock, then the lease; both rows at their newest versions.
        SELECT t.state, t.lease_epoch, f.status, f.config, f.completing, f.flow_type
          INTO v_state, v_epoch, v_status, v_config, v_completing, v_flow_type
          FROM flows f JOIN tasks t ON t.flow_id = f.flow_id
         WHERE f.flow_id = v_flow AND t.task_id = o_task[i]
           FOR UPDATE;
        IF NOT FOUND OR v_state <> 'running' OR v_epoch <> o_epoch[i] OR v_status <> 'running' THEN
            r_idx := i;
            r_kind := CASE WHEN NOT FOUND OR v_state <> 'running' OR v_epoch <> o_epoch[i]
                           THEN 'stale' ELSE 'inactive' END;
            r_task := NULL;
            r_seid := v_status;
            r_async := NULL;
            r_snapshot := NULL;
            RETURN NEXT;
            a_from := o_attr_end[i] + 1;
            m_from := o_move_end[i] + 1;
            CONTINUE;
        END IF;

        FOR j IN a_from .. o_attr_end[i] LOOP
            IF a_value[j] IS NULL THEN
                DELETE FROM attributes WHERE flow_id = v_flow AND name = a_name[j] AND key = a_key[j];
            ELSE
                INSERT INTO attributes (flow_id, name, key, value) VALUES (v_flow, a_name[j], a_key[j], a_value[j])
                ON CONFLICT (flow_id, name, key) DO UPDATE SET value = excluded.value;
            END IF;
        END LOOP;
        a_from := o_attr_end[i] + 1;
        IF o_release_locks[i] THEN
            DELETE FROM locks WHERE task_id = o_task[i];
        END IF;
        DELETE FROM tasks WHERE task_id = o_task[i];
        h_step := ARRAY[o_step_type[i]];
        h_seid := ARRAY[o_seid[i]];
        h_event := ARRAY['execute_completed'];
        h_attempt := ARRAY[o_attempt[i]];
        h_detail := ARRAY[o_kind[i]];

        v_async := NULL;
        FOR k IN m_from .. o_move_end[i] LOOP
            v_options := m_options[k];
            r_async := NULL;
            IF m_options_async[k] IS NOT NULL THEN
                -- E16: the flow config's default durability at this moment.
                IF v_async IS NULL THEN
                    v_async := coalesce(
                        convert_from(v_config, 'UTF8')::jsonb ->> 'default_step_durability' = 'ASYNC', FALSE);
                END IF;
                IF v_async THEN
                    v_options := m_options_async[k];
                END IF;
                r_async := v_async;
            END IF;
            v_snapshot := NULL;
            IF m_handoff[k] THEN
                IF m_load[k] IS NOT NULL THEN
                    -- E15: the state this method's first attempt (and every retry) sees, in the
                    -- snapshot format of _transitions._attempt_start: [[name, key, value], ...].
                    v_spec := m_load[k];
                    SELECT convert_to('[' || coalesce(string_agg(
                               '[' || to_json(s.name)::text || ',' || to_json(s.key)::text || ','
                               || convert_from(s.value, 'UTF8') || ']', ','), '') || ']', 'UTF8')
                      INTO v_snapshot
                      FROM (
                          SELECT a.name, a.key, a.value FROM attributes a
                           WHERE a.flow_id = v_flow AND coalesce(v_spec ->> 'mode', 'all') = 'all'
                          UNION ALL
                          SELECT a.name, a.key, a.value FROM attributes a
                           WHERE a.flow_id = v_flow AND v_spec ->> 'mode' = 'only'
                             AND a.name IN (SELECT jsonb_array_elements_text(v_spec -> 'names'))
                          UNION ALL
                          SELECT a.name, a.key, a.value FROM attributes a
                            JOIN jsonb_array_elements(v_spec -> 'instances') e
                              ON a.name = e ->> 0 AND a.key = e ->> 1
                           WHERE a.flow_id = v_flow AND v_spec ->> 'mode' = 'only'
                      ) s;
                END IF;
                -- The execution ID is <StepType>-<n>, n counted per flow and Step type.
                WITH c AS (
                    INSERT INTO step_counters (flow_id, step_type, n) VALUES (v_flow, m_step_type[k], 1)
                    ON CONFLICT (flow_id, step_type) DO UPDATE SET n = step_counters.n + 1 RETURNING n
                )
                INSERT INTO tasks (flow_id, flow_type, step_type, step_execution_id, input, options, method, state,
                                   attempt, run_at, created_at, lease_owner, lease_epoch, claimed_at,
                                   method_first_at, deadline_at, method_deadline_at, snapshot)
                SELECT v_flow, v_flow_type, m_step_type[k], m_step_type[k] || '-' || c.n, m_input[k], v_options,
                       m_method[k], 'running', 1, v_now, v_now, o_worker[i], 1, v_now, v_now, m_deadline[k],
                       m_method_deadline[k], v_snapshot
                  FROM c
                RETURNING task_id, step_execution_id INTO v_task, v_seid;
            ELSE
                WITH c AS (
                    INSERT INTO step_counters (flow_id, step_type, n) VALUES (v_flow, m_step_type[k], 1)
                    ON CONFLICT (flow_id, step_type) DO UPDATE SET n = step_counters.n + 1 RETURNING n
                )
                INSERT INTO tasks (flow_id, flow_type, step_type, step_execution_id, input, options, method, state,
                                   attempt, run_at, created_at)
                SELECT v_flow, v_flow_type, m_step_type[k], m_step_type[k] || '-' || c.n, m_input[k], v_options,
                       m_method[k], 'ready', 1, v_now, v_now
                  FROM c
                RETURNING task_id, step_execution_id INTO v_task, v_seid;
                v_notify := TRUE;
            END IF;
            r_idx := k;
            r_kind := 'task';
            r_task := v_task;
            r_seid := v_seid;
            r_snapshot := v_snapshot;
            RETURN NEXT;
            h_step := h_step || m_step_type[k];
            h_seid := h_seid || v_seid;
            h_event := h_event || 'step_scheduled'::TEXT;
            h_attempt := h_attempt || 0;
            h_detail := h_detail || ''::TEXT;
        END LOOP;
        m_from := o_move_end[i] + 1;

        IF o_graceful[i] THEN
            UPDATE flows SET completing = 1, completion_output = o_output[i] WHERE flow_id = v_flow;
            v_completing := 1;
        END IF;
        -- E12: a completing flow closes once no Step is left.
        IF v_completing <> 0 AND NOT EXISTS (SELECT 1 FROM tasks WHERE flow_id = v_flow) THEN
            UPDATE flows SET status = 'completed', output = completion_output, error = NULL, closed_at = v_now,
                             version = version + 1
             WHERE flow_id = v_flow;
            h_step := h_step || ''::TEXT;
            h_seid := h_seid || ''::TEXT;
            h_event := h_event || 'flow_closed'::TEXT;
            h_attempt := h_attempt || 0;
            h_detail := h_detail || 'completed'::TEXT;
        END IF;

        -- History (E13), as _transitions.flush_history: numbered from the flow's sequence, which
        -- also bumps the version RPCs validate against; trimmed when the sequence crosses a
        -- multiple of trim_every.
        v_count := array_length(h_event, 1);
        WITH f AS (
            UPDATE flows SET history_seq = history_seq + v_count, version = version + 1 WHERE flow_id = v_flow
            RETURNING history_seq
        ), trimmed AS (
            DELETE FROM history h USING f
             WHERE h.flow_id = v_flow AND mod(f.history_seq, trim_every) < v_count
               AND h.seq <= f.history_seq - keep_events
        )
        INSERT INTO history (flow_id, seq, step_type, step_execution_id, event_type, attempt, at, detail)
        SELECT v_flow, f.history_seq - v_count + u.ord, u.step_type, u.seid, u.event, u.attempt, v_now, u.detail
          FROM f, unnest(h_step, h_seid, h_event, h_attempt, h_detail) WITH ORDINALITY
               AS u (step_type, seid, event, attempt, detail, ord);
    END LOOP;
    IF v_notify THEN
        PERFORM pg_notify('dex_engine', '');
    END IF;
END
$$
