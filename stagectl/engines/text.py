"""Pure text rules of the server: request messages -> chat-template messages, and stop strings.

`normalize_messages` turns swift-style messages (string content with `<image>` tags, or lists of
`{"type": "image"}` / `{"type": "text"}` items) into the list form the Qwen-VL chat templates read;
`"<image>" * n + instruction` becomes exactly `models.chat.detection_messages(n, instruction)`, so the
server's prompt ids equal the learner's. `cut_at_stop` ends a generation at the first stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from stagectl.wire.protocol import IMAGE_TAG, Message


def normalize_messages(messages: Sequence[Message], num_images: int) -> list[dict[str, Any]]:
    """Template messages with one `{"type": "image"}` per image placeholder; the placeholder count must
    equal `num_images` and the last message must be the user's (a generation prompt follows it)."""
    if messages[-1].role != "user":
        raise ValueError(f"the last message must have role 'user', got {messages[-1].role!r}")
    out: list[dict[str, Any]] = []
    num_placeholders = 0
    for message in messages:
        items: list[dict[str, Any]] = []
        if isinstance(message.content, str):
            for k, piece in enumerate(message.content.split(IMAGE_TAG)):
                if k > 0:
                    items.append({"type": "image"})
                if piece:
                    items.append({"type": "text", "text": piece})
        else:
            for item in message.content:
                if item.type == "image":
                    items.append({"type": "image"})
                elif item.text is None:
                    raise ValueError("a content item of type 'text' needs a 'text' field")
                else:
                    items.append({"type": "text", "text": item.text})
        num_placeholders += sum(item["type"] == "image" for item in items)
        if message.role != "user" and any(item["type"] == "image" for item in items):
            raise ValueError(
                f"images are only allowed in user messages, found one in a {message.role!r} message"
            )
        if items and all(item["type"] == "text" for item in items):
            out.append({"role": message.role, "content": "".join(item["text"] for item in items)})
        else:
            out.append({"role": message.role, "content": items})
    if num_placeholders != num_images:
        raise ValueError(
            f"the messages have {num_placeholders} image placeholders but the request has {num_images} images"
        )
    return out


def cut_at_stop(
    token_ids: Sequence[int], stop: Sequence[str], decode: Callable[[Sequence[int]], str]
) -> tuple[list[int], str, bool]:
    """(token ids up to the token that completes the first stop string, the text before it, hit).

    Without a hit: all ids, their full text, False. The shortest hitting prefix is found by bisection
    (a decoded prefix never loses a stop string it already contains), so this costs O(log n) decodes.
    """
    ids = list(token_ids)
    text = decode(ids)
    stops = [s for s in stop if s and s in text]
    if not stops:
        return ids, text, False
    end = len(ids)
    for s in stops:
        lo, hi = 1, end
        while lo < hi:
            mid = (lo + hi) // 2
            if s in decode(ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        end = min(end, lo)
    kept = ids[:end]
    kept_text = decode(kept)
    cut = min(kept_text.find(s) for s in stops if s in kept_text)
    return kept, kept_text[:cut], True
