"""Stage-B, the training-free guidance loop (`stagectl stage-b`).

Pure cores: `tickets` (the data), `guidance` + `guidance_ops` (the rules and their edits), `prompts`,
`verdict` (the two-line output contract), `selection` (votes), `sharding`, `metrics`.
Shells: `guidance_store` and `artifacts` (rank-0 files), `engine` (the model interface) with
`engine_hf` and `engine_rules`, `reflection` (one reflection step), `runner` (`run_all`, the loop).
"""
