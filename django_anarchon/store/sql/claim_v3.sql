-- django_anarchon_claim() v3 (migration 0005): as v2, but losers of a slot wait on an advisory lock
-- (two-key form, class __ADVISORY_CLASS__) instead of the job row lock, so they write nothing.
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
    names text[] := '{}';       -- jobs of the open claims, then sorted: the lock order
    locked text[] := '{}';
    paused_jobs text[] := '{}';
    missing text[] := '{}';     -- no job row: the Python path creates it
    waiting text[] := '{}';     -- held by another transaction at the first try
    got text[];
    got_paused text[];
    got_missing text[];
    active_jobs text[] := '{}';
    idle_jobs text[] := '{}';
    lock_wait text;
    settled text[] := '{}';     -- every open claim decided by others while we waited: lost, nothing locked
    still_open boolean;
    got_row boolean;
    budget integer := p_capacity;
    i integer;
    v_job text;
    v_slot bigint;
    v_paused boolean;
    now_ts timestamptz;
    at_slot timestamptz;
    new_id bigint;
    new_created timestamptz;
    new_started timestamptz;
    new_lease timestamptz;
BEGIN
    -- Unlocked first look: slots already decided are lost, without taking any lock.
    FOR i IN 1..n LOOP
        v_job := p_jobs[i];
        v_slot := p_slots[i];
        PERFORM FROM __RUN_TABLE__ r WHERE r.job = v_job AND r.slot = v_slot AND r.attempt = 1;
        IF NOT FOUND THEN
            open_claims := open_claims || i;
            IF NOT v_job = ANY(names) THEN
                names := names || v_job;
            END IF;
        END IF;
    END LOOP;
    IF cardinality(open_claims) = 0 THEN
        RETURN;
    END IF;
    IF cardinality(names) > 1 THEN
        SELECT array_agg(x ORDER BY x) INTO names FROM unnest(names) AS x;
    END IF;

    -- The job locks, in name order; each locked row is its latest version, pause included.
    IF p_skip_locked THEN
        FOREACH v_job IN ARRAY names LOOP
            -- The advisory lock first: it is what waiters below wait on without writing.
            got_row := false;
            IF pg_try_advisory_xact_lock(__ADVISORY_CLASS__, hashtext(v_job)) THEN
                SELECT js.paused INTO v_paused FROM __JOBSTATE_TABLE__ js
                WHERE js.name = v_job FOR UPDATE SKIP LOCKED;
                got_row := FOUND;
            END IF;
            IF got_row THEN
                locked := locked || v_job;
                IF v_paused THEN paused_jobs := paused_jobs || v_job; END IF;
            ELSE
                waiting := waiting || v_job;  -- held elsewhere, or no row
            END IF;
        END LOOP;
        IF cardinality(waiting) > 0 THEN
            -- Held by another transaction, most often another instance's claim of the very
            -- same slot, over in a millisecond: wait for it briefly rather than answer busy.
            -- Wait on the advisory lock, which takes no transaction id and writes nothing,
            -- then look again: a slot decided meanwhile is lost without ever locking the
            -- job row (locking it would cost a WAL record and a flushed commit per loser).
            -- Otherwise (another slot of the job, a holder that is not a claim) wait for the
            -- row itself. Past the timeout the block's locks are released and the jobs not
            -- settled are busy, for the caller to try again later.
            lock_wait := current_setting('lock_timeout');
            PERFORM set_config('lock_timeout', p_lock_wait_ms || 'ms', true);
            got := '{}';
            got_paused := '{}';
            got_missing := '{}';
            BEGIN
                FOREACH v_job IN ARRAY waiting LOOP
                    PERFORM pg_advisory_xact_lock_shared(__ADVISORY_CLASS__, hashtext(v_job));
                    still_open := false;  -- has v_job a claim still undecided?
                    FOREACH i IN ARRAY open_claims LOOP
                        IF p_jobs[i] = v_job THEN
                            PERFORM FROM __RUN_TABLE__ r
                            WHERE r.job = v_job AND r.slot = p_slots[i] AND r.attempt = 1;
                            IF NOT FOUND THEN
                                still_open := true;
                                EXIT;
                            END IF;
                        END IF;
                    END LOOP;
                    IF NOT still_open THEN
                        settled := settled || v_job;
                        CONTINUE;
                    END IF;
                    SELECT js.paused INTO v_paused FROM __JOBSTATE_TABLE__ js
                    WHERE js.name = v_job FOR UPDATE;
                    IF FOUND THEN
                        got := got || v_job;
                        IF v_paused THEN got_paused := got_paused || v_job; END IF;
                    ELSE
                        got_missing := got_missing || v_job;
                    END IF;
                END LOOP;
                locked := locked || got;
                paused_jobs := paused_jobs || got_paused;
                missing := got_missing;
            EXCEPTION WHEN lock_not_available THEN
                NULL;
            END;
            PERFORM set_config('lock_timeout', lock_wait, true);
            FOREACH v_job IN ARRAY waiting LOOP
                IF NOT v_job = ANY(locked) AND NOT v_job = ANY(missing) AND NOT v_job = ANY(settled) THEN
                    RETURN QUERY SELECT 'busy'::text, v_job, NULL::bigint, NULL::bigint,
                        NULL::timestamptz, NULL::timestamptz, NULL::timestamptz;
                END IF;
            END LOOP;
        END IF;
    ELSE
        FOREACH v_job IN ARRAY names LOOP
            SELECT js.paused INTO v_paused FROM __JOBSTATE_TABLE__ js
            WHERE js.name = v_job FOR UPDATE;
            IF FOUND THEN
                locked := locked || v_job;
                IF v_paused THEN paused_jobs := paused_jobs || v_job; END IF;
            ELSE
                missing := missing || v_job;
            END IF;
        END LOOP;
    END IF;

    -- Under the locks each statement takes a new snapshot: everything committed
    -- before is visible. Claims in (slot, job) order, as given.
    now_ts := clock_timestamp();
    FOREACH i IN ARRAY open_claims LOOP
        v_job := p_jobs[i];
        v_slot := p_slots[i];
        IF v_job = ANY(missing) THEN
            RETURN QUERY SELECT 'undecided'::text, v_job, v_slot, NULL::bigint,
                NULL::timestamptz, NULL::timestamptz, NULL::timestamptz;
            CONTINUE;
        END IF;
        IF NOT v_job = ANY(locked) OR v_job = ANY(paused_jobs) THEN
            CONTINUE;  -- busy (answered above) or paused
        END IF;
        PERFORM FROM __RUN_TABLE__ r WHERE r.job = v_job AND r.slot = v_slot AND r.attempt = 1;
        IF FOUND THEN
            CONTINUE;  -- decided by someone else meanwhile
        END IF;
        IF NOT (v_job = ANY(active_jobs) OR v_job = ANY(idle_jobs)) THEN
            -- Running, or handed over and waiting: the partial index anarchon_run_active.
            PERFORM FROM __RUN_TABLE__ r
            WHERE r.job = v_job AND (r.status = 'running' OR (r.status = 'pending' AND r.attempt > 1));
            IF FOUND THEN
                active_jobs := active_jobs || v_job;
            ELSE
                idle_jobs := idle_jobs || v_job;
            END IF;
        END IF;
        IF v_job = ANY(active_jobs) AND NOT p_allow[i] THEN
            -- Busy job: skip, queue, replace or wait is the overlap policy's call.
            RETURN QUERY SELECT 'undecided'::text, v_job, v_slot, NULL::bigint,
                NULL::timestamptz, NULL::timestamptz, NULL::timestamptz;
            CONTINUE;
        END IF;
        IF budget <= 0 THEN
            RETURN QUERY SELECT 'deferred'::text, v_job, v_slot, NULL::bigint,
                NULL::timestamptz, NULL::timestamptz, NULL::timestamptz;
            CONTINUE;
        END IF;
        at_slot := timestamptz 'epoch' + v_slot * interval '1 millisecond';
        new_id := NULL;
        INSERT INTO __RUN_TABLE__ AS r (
            job, slot, attempt, status, reason, manual, scheduled_at, instance_id, owner,
            lease_expires_at, created_at, started_at, finished_at, data, progress,
            error_type, error_message, traceback, detail
        ) VALUES (
            v_job, v_slot, 1, 'running', 'scheduled', false, at_slot, p_instance, p_owner,
            now_ts + p_ttl * interval '1 second', now_ts, greatest(now_ts, at_slot), NULL,
            p_data[i]::jsonb, NULL, '', '', '', ''
        )
        ON CONFLICT DO NOTHING
        RETURNING r.id, r.created_at, r.started_at, r.lease_expires_at
        INTO new_id, new_created, new_started, new_lease;
        IF new_id IS NOT NULL THEN
            budget := budget - 1;
            IF NOT p_allow[i] THEN
                active_jobs := active_jobs || v_job;
            END IF;
            RETURN QUERY SELECT 'won'::text, v_job, v_slot, new_id, new_created, new_started, new_lease;
        END IF;
    END LOOP;
END
$fn$;
