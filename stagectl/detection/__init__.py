"""Stage-2 AB detection cores (pure: no I/O, no threads, no torch).

- `coords`: the norm-1000 codec and the `<|coord_B|>` tokens.
- `vocab`: `TokenVocab`, the token bytes and special ids the parser and targets need.
- `serialize`: objects -> the assistant JSON; the FN-append fragment.
- `parse`: strict, token-aligned rollout parsing -> kept / dropped objects and a reusable prefix.
- `matching`: Hungarian matching with an IoU gate.
- `targets`: Channel-A / Channel-B teacher-forced segments and per-sample counters.
"""
