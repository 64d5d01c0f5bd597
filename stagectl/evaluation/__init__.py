"""Detection evaluation shared by `stagectl eval` and train-ab's periodic eval: rollouts -> strict parse ->
per-object scores -> COCO results -> COCO bbox metrics (faster-coco-eval), plus F1 at IoU 0.5."""
