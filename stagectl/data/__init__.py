"""stagectl.data: detection samples, the JSONL loader, the synthetic shapes data set and the samplers.

`sample` (DetectionSample, norm-1000 box codec), `jsonl` (load_jsonl_dataset, DataError), `coco` (COCO
instances file -> JSONL: convert_coco_file), `synthetic` (generate_synthetic), `sampler` (ShardedSampler). Nothing is re-exported here, so importing one module
does not pull in the others (the synthetic module imports pillow).
"""
