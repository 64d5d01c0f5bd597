"""Duplicate predictions in one rollout: the "duplicate burst" failure mode of detection LMs (the same
object written again, often several times, with a near-identical box).

A valid prediction is a duplicate when its IoU with an EARLIER ACCEPTED prediction of the same desc is
>= `iou_threshold`; accepted = not itself a duplicate. Pure: objects in, indices out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stagectl.detection.matching import pairwise_iou
from stagectl.detection.serialize import BoxedObject


def find_duplicates(objects: Sequence[BoxedObject], iou_threshold: float) -> list[int]:
    """Indices (ascending) of the duplicates among `objects` (in rollout order)."""
    if not 0 < iou_threshold <= 1:
        raise ValueError(f"iou_threshold must be in (0, 1], got {iou_threshold}")
    if len(objects) < 2:
        return []
    boxes = np.asarray([list(o.bbox_2d) for o in objects], dtype=np.float64)  # [N, 4]
    iou = pairwise_iou(boxes, boxes)  # [N, N]
    accepted: list[int] = []
    duplicates: list[int] = []
    for i, obj in enumerate(objects):
        if any(objects[k].desc == obj.desc and iou[i, k] >= iou_threshold for k in accepted):
            duplicates.append(i)
        else:
            accepted.append(i)
    return duplicates
