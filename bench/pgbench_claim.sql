\set k random(1, 4611686018427387903)
INSERT INTO benchapp_claimref (k) VALUES (:k) ON CONFLICT (k) DO NOTHING;
