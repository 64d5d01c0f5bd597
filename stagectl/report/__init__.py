"""`stagectl report RUN_DIR`: a markdown summary and PNG plots of a train-ab run or a Stage-B mission.

`detect` finds what RUN_DIR holds, `jsonl` reads the rows (tolerating a torn last line), `train_ab`
and `stage_b` are the pure summaries, `markdown` renders them, `plots_*` draw them (matplotlib, Agg)
and `write` ties it together. Only `write` and `plots_*` touch the file system.
"""
