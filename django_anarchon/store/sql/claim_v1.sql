-- django_anarchon_claim() v1 (migration 0003): a scheduled claim in one round trip.
-- The plain case of store.decide(): the unlocked first look, the job rows locked in name order,
-- then one running row per claim. A busy job or a missing job row is handed back undecided.
CREATE OR REPLACE FUNCTION django_anarchon_claim(
    p_jobs text[],          -- one entry per claim, in (slot, job) order
    p_slots bigint[],
    p_allow boolean[],      -- the job's overlap is 'allow'
    p_data text[],          -- the run data as JSON text, NULL for none
    p_owner text,
    p_instance text,
    p_ttl double precision,
    p_capacity integer,
    p_skip_locked boolean,
    p_lock_wait_ms integer  -- with p_skip_locked: how long to wait for a job held elsewhere
) RETURNS TABLE (
    kind text, job text, slot bigint, run_id bigint,
    created_at timestamptz, started_at timestamptz, lease_expires_at timestamptz
) LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    n integer := coalesce(array_length(p_jobs, 1), 0);
    open_claims integer[] := '{}';
    names text[] := '{}';
    locked text[];
    existing text[];
    paused_jobs text[];
    active_jobs text[];
    taken text[];
    lock_wait text;
    budget integer := p_capacity;
    i integer;
    now_ts timestamptz;
    at_slot timestamptz;
    new_id bigint;
    new_created timestamptz;
    new_started timestamptz;
    new_lease timestamptz;
BEGIN
    -- Unlocked first look: slots already decided are lost, without taking any lock.
    SELECT array_agg(r.job || '|' || r.slot) INTO taken
    FROM __RUN_TABLE__ r
    WHERE r.attempt = 1 AND r.job = ANY(p_jobs) AND r.slot = ANY(p_slots);
    taken := coalesce(taken, '{}');
    FOR i IN 1..n LOOP
        IF NOT (p_jobs[i] || '|' || p_slots[i]) = ANY(taken) THEN
            open_claims := open_claims || i;
            IF NOT p_jobs[i] = ANY(names) THEN
                names := names || p_jobs[i];
            END IF;
        END IF;
    END LOOP;
    IF cardinality(open_claims) = 0 THEN
        RETURN;
    END IF;

    -- The job locks, in name order; each locked row is its latest version, pause included.
    IF p_skip_locked THEN
        SELECT coalesce(array_agg(s.name), '{}'), coalesce(array_agg(s.name) FILTER (WHERE s.paused), '{}')
        INTO locked, paused_jobs
        FROM (
            SELECT js.name, js.paused FROM __JOBSTATE_TABLE__ js
            WHERE js.name = ANY(names) ORDER BY js.name FOR UPDATE SKIP LOCKED
        ) s;
        IF cardinality(locked) < cardinality(names) THEN
            -- Held by another transaction, most often another instance's claim of the very
            -- same slot, over in a millisecond: wait for it briefly rather than answer busy.
            -- Past the timeout they are busy, for the caller to try again later.
            lock_wait := current_setting('lock_timeout');
            PERFORM set_config('lock_timeout', p_lock_wait_ms || 'ms', true);
            BEGIN
                SELECT locked || coalesce(array_agg(s.name), '{}'),
                       paused_jobs || coalesce(array_agg(s.name) FILTER (WHERE s.paused), '{}')
                INTO locked, paused_jobs
                FROM (
                    SELECT js.name, js.paused FROM __JOBSTATE_TABLE__ js
                    WHERE js.name = ANY(names) AND NOT js.name = ANY(locked) ORDER BY js.name FOR UPDATE
                ) s;
            EXCEPTION WHEN lock_not_available THEN
                NULL;
            END;
            PERFORM set_config('lock_timeout', lock_wait, true);
        END IF;
    ELSE
        SELECT coalesce(array_agg(s.name), '{}'), coalesce(array_agg(s.name) FILTER (WHERE s.paused), '{}')
        INTO locked, paused_jobs
        FROM (
            SELECT js.name, js.paused FROM __JOBSTATE_TABLE__ js
            WHERE js.name = ANY(names) ORDER BY js.name FOR UPDATE
        ) s;
    END IF;
    IF cardinality(locked) < cardinality(names) THEN
        SELECT array_agg(js.name) INTO existing FROM __JOBSTATE_TABLE__ js
        WHERE js.name = ANY(names) AND NOT js.name = ANY(locked);
        existing := coalesce(existing, '{}');
        RETURN QUERY SELECT 'busy'::text, e, NULL::bigint, NULL::bigint,
            NULL::timestamptz, NULL::timestamptz, NULL::timestamptz FROM unnest(existing) AS e;
    END IF;

    -- Under the locks, a new snapshot: everything committed before is visible. What the
    -- jobs are doing (running, or handed over) and which of the slots are decided, at once.
    SELECT coalesce(array_agg(DISTINCT r.job) FILTER (
               WHERE r.status = 'running' OR (r.status = 'pending' AND r.attempt > 1)), '{}'),
           coalesce(array_agg(r.job || '|' || r.slot) FILTER (WHERE r.attempt = 1 AND r.slot = ANY(p_slots)), '{}')
    INTO active_jobs, taken
    FROM __RUN_TABLE__ r
    WHERE r.job = ANY(locked)
      AND (r.status = 'running' OR (r.status = 'pending' AND r.attempt > 1)
           OR (r.attempt = 1 AND r.slot = ANY(p_slots)));
    now_ts := clock_timestamp();

    FOREACH i IN ARRAY open_claims LOOP
        IF NOT p_jobs[i] = ANY(locked) THEN
            IF NOT p_jobs[i] = ANY(coalesce(existing, '{}')) THEN
                -- No job row yet: the Python path creates it.
                RETURN QUERY SELECT 'undecided'::text, p_jobs[i], p_slots[i], NULL::bigint,
                    NULL::timestamptz, NULL::timestamptz, NULL::timestamptz;
            END IF;
            CONTINUE;
        END IF;
        IF p_jobs[i] = ANY(paused_jobs) OR (p_jobs[i] || '|' || p_slots[i]) = ANY(taken) THEN
            CONTINUE;
        END IF;
        IF p_jobs[i] = ANY(active_jobs) AND NOT p_allow[i] THEN
            -- Busy job: skip, queue, replace or wait is the overlap policy's call.
            RETURN QUERY SELECT 'undecided'::text, p_jobs[i], p_slots[i], NULL::bigint,
                NULL::timestamptz, NULL::timestamptz, NULL::timestamptz;
            CONTINUE;
        END IF;
        IF budget <= 0 THEN
            RETURN QUERY SELECT 'deferred'::text, p_jobs[i], p_slots[i], NULL::bigint,
                NULL::timestamptz, NULL::timestamptz, NULL::timestamptz;
            CONTINUE;
        END IF;
        at_slot := timestamptz 'epoch' + p_slots[i] * interval '1 millisecond';
        new_id := NULL;
        INSERT INTO __RUN_TABLE__ AS r (
            job, slot, attempt, status, reason, manual, scheduled_at, instance_id, owner,
            lease_expires_at, created_at, started_at, finished_at, data, progress,
            error_type, error_message, traceback, detail
        ) VALUES (
            p_jobs[i], p_slots[i], 1, 'running', 'scheduled', false, at_slot, p_instance, p_owner,
            now_ts + p_ttl * interval '1 second', now_ts, greatest(now_ts, at_slot), NULL,
            p_data[i]::jsonb, NULL, '', '', '', ''
        )
        ON CONFLICT DO NOTHING
        RETURNING r.id, r.created_at, r.started_at, r.lease_expires_at
        INTO new_id, new_created, new_started, new_lease;
        IF new_id IS NOT NULL THEN
            budget := budget - 1;
            taken := taken || (p_jobs[i] || '|' || p_slots[i]);
            IF NOT p_allow[i] THEN
                active_jobs := active_jobs || p_jobs[i];
            END IF;
            RETURN QUERY SELECT 'won'::text, p_jobs[i], p_slots[i], new_id, new_created, new_started, new_lease;
        END IF;
    END LOOP;
END
$fn$;
