"""codec.encode refuses oversized text with a picklehooks error (issue 11)."""

from __future__ import annotations

import pytest

import picklehooks
from picklehooks import codec


class TestOversizedSource:
    def test_is_a_picklehooks_error_and_a_value_error(self):
        """Text over the default bound raises SourceTooLargeError: a PicklehooksError and still a ValueError."""
        source = "x = 1\n" * (codec.MAX_SOURCE_BYTES // 6 + 1)
        with pytest.raises(picklehooks.PicklehooksError) as info:
            codec.encode(source)
        assert isinstance(info.value, ValueError)
        assert isinstance(info.value, codec.SourceTooLargeError)

    def test_message_names_the_size_the_bound_and_the_fix(self):
        """The message quotes the text's size in bytes, the bound, and says to make the hook smaller."""
        source = "é" * (codec.MAX_SOURCE_BYTES // 2 + 1)  # 2 bytes per character in UTF-8
        size = len(source.encode("utf-8"))
        with pytest.raises(codec.SourceTooLargeError) as info:
            codec.encode(source)
        message = str(info.value)
        assert f"{size} bytes" in message
        assert str(codec.MAX_SOURCE_BYTES) in message
        assert "make the hook smaller" in message

    def test_text_at_the_bound_still_encodes(self):
        """Exactly MAX_SOURCE_BYTES bytes is allowed and round-trips."""
        source = "#" * codec.MAX_SOURCE_BYTES
        assert codec.decode(codec.encode(source)) == source
