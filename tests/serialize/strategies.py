"""Hypothesis strategies for the codec tests."""

from __future__ import annotations

from hypothesis import strategies as st

#: Any text at all, including surrogate-free unicode, empty strings and NULs.
sources = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=2000)

#: Text that looks like hook code, so the dictionary has something to match.
hook_like = st.builds(
    lambda name, body: f"import torch\ndef {name}(module, inputs, output):\n    {body}\n",
    st.from_regex(r"[a-z_][a-z0-9_]{0,15}", fullmatch=True),
    st.sampled_from(["return output", "return output * 2", "print(output.mean())", "pass"]),
)

#: Names that may or may not be hook names.
names = st.one_of(
    st.text(max_size=200),
    st.from_regex(r"[a-z][A-Z2-7_]{0,120}", fullmatch=True),
)
