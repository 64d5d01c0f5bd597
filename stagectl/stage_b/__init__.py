"""Stage-B, the training-free guidance loop (`stagectl stage-b`).

Pure cores: `tickets` (the data), `guidance` + `guidance_ops` (the rules and their edits), `prompts`,
`verdict` (the two-line output contract), `selection` (votes), `rows` (a judged ticket's rows), `sharding`,
`metrics`. Shells: `guidance_store` and `artifacts` (rank-0 files), `engine` (the `runner.engine` backends' interface) with
`engine_model`, `engine_server` and `engine_rules`, `reflection` (one reflection step), `judge` (every rank:
its shard of a global batch), `consumer` (rank 0: writer, store, window, reflection queue), `start` (rank 0's
start-up checks, a resume's point, the run directory) and `runner` (`run_all`: the start-up, then the loop over
global batches).
"""
