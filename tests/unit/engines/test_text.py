"""Pure text rules of the rollout server: message normalisation and stop strings."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from stagectl.engines.text import cut_at_stop, normalize_messages
from stagectl.models.chat import detection_messages
from stagectl.wire.protocol import ContentItem, Message


def _decode(ids: Sequence[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("num_images", [0, 1, 3])
def test_image_tags_become_detection_messages(num_images: int) -> None:
    message = Message(role="user", content="<image>" * num_images + "Find every object.")
    expected = detection_messages(num_images, "Find every object.")
    if num_images == 0:  # text-only content stays a string (the templates render both alike)
        expected = [{"role": "user", "content": "Find every object."}]
    assert normalize_messages([message], num_images) == expected


def test_content_items_and_interleaved_tags() -> None:
    items = Message(
        role="user",
        content=[
            ContentItem(type="text", text="a"),
            ContentItem(type="image"),
            ContentItem(type="text", text="b"),
        ],
    )
    tags = Message(role="user", content="a<image>b")
    assert normalize_messages([items], 1) == normalize_messages([tags], 1)
    assert normalize_messages([tags], 1)[0]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "image"},
        {"type": "text", "text": "b"},
    ]


def test_system_message_kept_as_text() -> None:
    out = normalize_messages(
        [Message(role="system", content="sys"), Message(role="user", content="<image>x")], 1
    )
    assert out[0] == {"role": "system", "content": "sys"}


@pytest.mark.parametrize(
    ("messages", "num_images", "error"),
    [
        ([Message(role="user", content="<image><image>x")], 1, "2 image placeholders but the request has 1"),
        ([Message(role="user", content="x")], 1, "0 image placeholders"),
        ([Message(role="assistant", content="x")], 0, "last message must have role 'user'"),
        (
            [Message(role="system", content="<image>"), Message(role="user", content="x")],
            1,
            "only allowed in user",
        ),
        ([Message(role="user", content=[ContentItem(type="text")])], 0, "needs a 'text' field"),
    ],
)
def test_bad_messages(messages: list[Message], num_images: int, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        normalize_messages(messages, num_images)


def test_cut_at_stop_without_hit_keeps_everything() -> None:
    ids = list(b"hello world")
    assert cut_at_stop(ids, ["xyz"], _decode) == (ids, "hello world", False)
    assert cut_at_stop(ids, [], _decode) == (ids, "hello world", False)


def test_cut_at_stop_ends_at_the_completing_token() -> None:
    ids = list(b"abc STOP def")
    kept, text, hit = cut_at_stop(ids, ["STOP"], _decode)
    assert hit and text == "abc " and kept == list(b"abc STOP")


def test_cut_at_stop_takes_the_earliest_of_several() -> None:
    ids = list(b"one;two|three")
    kept, text, hit = cut_at_stop(ids, ["|", ";"], _decode)
    assert hit and text == "one" and kept == list(b"one;")


def test_cut_at_stop_with_multi_byte_tokens() -> None:
    # "token" = several bytes: a stop string completed in the middle of a token keeps that token.
    table = {1: "ab", 2: "c]", 3: "de"}

    def decode(ids: Sequence[int]) -> str:
        return "".join(table[i] for i in ids)

    kept, text, hit = cut_at_stop([1, 2, 3], ["c]"], decode)
    assert (kept, text, hit) == ([1, 2], "ab", True)
