-- The database side of one scheduled claim, with no Python: django_anarchon_claim() called by
-- pgbench. Consecutive groups of :clients calls share a slot, so every client races for every
-- slot, as instances do; :base and :jobs come from bench/scenarios/claims.py (-D).
SELECT nextval('anarchon_bench_claim_seq') AS q \gset
\set j (:q / :clients) % :jobs
\set s :base + (:q / :clients) * 1000
SELECT * FROM django_anarchon_claim(ARRAY['claim-' || lpad(:j::text, 5, '0')], ARRAY[:s::bigint], ARRAY[false], ARRAY[NULL::text], 'bench', 'bench', 30, 1, true, 10);
