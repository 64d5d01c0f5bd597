"""The inference client (core): `client.RolloutClient` (health, `/infer/` with retries, splits and
failover) and `requests` (building detection requests, reading answers, chunk arithmetic). Inference
only: it never reaches `weightsync`. Used by the learner, the prefetcher, eval and Stage-B."""
