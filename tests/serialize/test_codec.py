"""The codec: round trips, identifier shape, bounds and rejection of bad names."""

from __future__ import annotations

import base64
import keyword
import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import picklehooks
from picklehooks import _shim, codec
from tests.serialize.strategies import hook_like, names, sources
from tests.testutils import run_fresh


class TestRoundTrip:
    @given(sources)
    def test_any_text_round_trips(self, source):
        """decode(encode(s)) == s for arbitrary text."""
        assert codec.decode(codec.encode(source)) == source

    @given(st.one_of(sources, hook_like))
    def test_names_are_identifiers(self, source):
        """Every name is an identifier, not a keyword, without dots, behind the format letter."""
        name = codec.encode(source)
        assert name.isidentifier() and not keyword.iskeyword(name)
        assert "." not in name
        assert name[0] == _shim.CURRENT_FORMAT

    @given(hook_like)
    def test_deterministic(self, source):
        """The same source gives the same name twice."""
        assert codec.encode(source) == codec.encode(source)

    def test_deterministic_across_processes(self):
        """A fresh interpreter computes the same names."""
        sources_ = ["", "def f(m, i, o):\n    return o\n", "import torch\n" * 50]
        child = run_fresh(
            "import sys, json\nfrom picklehooks import codec\n"
            "print(json.dumps([codec.encode(s) for s in json.loads(sys.argv[1])]))",
            __import__("json").dumps(sources_),
        )
        assert __import__("json").loads(child) == [codec.encode(s) for s in sources_]

    def test_dictionary_makes_hook_names_shorter(self):
        """The shipped dictionary shortens typical hook names (what the format pays for)."""
        source = "import torch\ndef hook(module, inputs, output):\n    return output * 2\n"
        _shim.FORMATS["z"] = None
        try:
            plain = codec.encode(source, format="z")
            assert codec.decode(plain) == source
        finally:
            del _shim.FORMATS["z"]
        assert len(codec.encode(source)) < 0.8 * len(plain)

    def test_encode_rejects_non_str(self):
        """encode() names the wrong type."""
        with pytest.raises(TypeError, match="bytes"):
            codec.encode(b"def f(): pass")


class TestErrors:
    def test_decode_error_hierarchy(self):
        """DecodeError is both the package's error and an AttributeError."""
        assert issubclass(picklehooks.DecodeError, picklehooks.PicklehooksError)
        assert issubclass(picklehooks.DecodeError, AttributeError)

    @pytest.mark.parametrize(
        "name, fragment",
        [
            ("", "empty"),
            ("zABCDEFGH", "not a picklehooks format letter"),
            ("aABC", "truncated or malformed"),
            ("aabcdefgh", "outside base32"),
            ("a" + "A" * 8, "not a picklehooks name"),
            (17, "must be a str"),
        ],
    )
    def test_messages_say_what_is_wrong(self, name, fragment):
        """Each kind of bad name gets a message naming the problem."""
        with pytest.raises(picklehooks.DecodeError, match=fragment):
            codec.decode(name)

    def test_truncated(self):
        """Every proper prefix of a real name is refused."""
        name = codec.encode("def hook(module, inputs, output):\n    return output\n" * 3)
        for cut in range(1, len(name)):
            with pytest.raises(picklehooks.DecodeError):
                codec.decode(name[:cut])

    @settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
    @given(names)
    def test_fuzzed_names_only_raise_decode_error(self, name):
        """Arbitrary strings either decode or raise DecodeError, nothing else."""
        try:
            result = codec.decode(name)
        except picklehooks.DecodeError:
            return
        assert isinstance(result, str)

    @settings(max_examples=300)
    @given(hook_like, st.data())
    def test_mutated_names_are_caught(self, source, data):
        """Changing, deleting or inserting one character never yields other text."""
        name = codec.encode(source)
        pos = data.draw(st.integers(0, len(name) - 1))
        op = data.draw(st.sampled_from(["replace", "delete", "insert"]))
        char = data.draw(st.sampled_from("abcAZ27_Q3"))
        if op == "replace":
            mutated = name[:pos] + char + name[pos + 1 :]
        elif op == "delete":
            mutated = name[:pos] + name[pos + 1 :]
        else:
            mutated = name[:pos] + char + name[pos:]
        try:
            result = codec.decode(mutated)
        except picklehooks.DecodeError:
            return
        # Only a change in base32's unused low bits can leave the bytes intact.
        assert result == source

    @settings(max_examples=100)
    @given(names)
    def test_hub_lookup_only_raises_attribute_error(self, name):
        """getattr on the hub with any name raises AttributeError (DecodeError is one)."""
        hub = _shim.hub()
        # Names the module already has (its own, or a module's, like __dict__) aren't looked up by __getattr__.
        if not name.isidentifier() or name in hub.__dict__ or hasattr(type(hub), name):
            return
        with pytest.raises(AttributeError):
            getattr(hub, name)


def _frame(data: bytes, *, declared: int | None = None) -> str:
    """Build a name for raw bytes, optionally lying about the content size."""
    frame = codec._compressor(_shim.CURRENT_FORMAT)(data)[4:]
    if declared is not None:
        # Rewrite the 4-byte frame content size (descriptor 0b10..) by hand.
        assert frame[0] >> 6 == 2, "test expects a 4-byte content-size field"
        frame = frame[:1] + declared.to_bytes(4, "little") + frame[5:]
    return _shim.CURRENT_FORMAT + base64.b32encode(frame).decode().replace("=", "_")


class TestBounds:
    def test_bomb_over_the_default_limit(self):
        """A tiny name that would decompress past the limit is refused before decompressing."""
        name = _frame(b"a" * (3 << 20))
        assert len(name) < 2000
        with pytest.raises(picklehooks.DecodeError, match="over the limit"):
            codec.decode(name)

    def test_limit_is_configurable(self):
        """max_source_bytes and set_max_source_bytes move the bound."""
        source = "x = 1\n" * 200
        name = codec.encode(source)
        with pytest.raises(picklehooks.DecodeError, match="over the limit of 100"):
            codec.decode(name, max_source_bytes=100)
        old = codec.set_max_source_bytes(100)
        try:
            with pytest.raises(picklehooks.DecodeError):
                codec.decode(name)
        finally:
            codec.set_max_source_bytes(old)
        assert codec.decode(name) == source

    def test_lying_content_size(self):
        """A frame declaring less than it holds is caught by zstd's bounded output."""
        name = _frame(b"b" * 100_000, declared=10)
        with pytest.raises(picklehooks.DecodeError, match="corrupt"):
            codec.decode(name)

    def test_set_max_source_bytes_validates(self):
        """A bad bound names the value."""
        with pytest.raises(ValueError, match="-5"):
            codec.set_max_source_bytes(-5)

    def test_non_utf8(self):
        """Bytes that are not UTF-8 are refused."""
        with pytest.raises(picklehooks.DecodeError, match="UTF-8"):
            codec.decode(_frame(b"\xff\xfe\xfa"))


class TestPickleOfErrors:
    def test_decode_error_pickles(self):
        """DecodeError survives pickling (it crosses process boundaries in spawn workers)."""
        err = pickle.loads(pickle.dumps(picklehooks.DecodeError("bad name")))
        assert isinstance(err, picklehooks.DecodeError) and str(err) == "bad name"
