"""The serializer layer: a hook's source text as a function *name* that pickle carries.

* :mod:`~picklehooks.serialize.codec`: source text <-> name (zstd, base32, a format letter);
* :mod:`~picklehooks.serialize.portable`: a Python function -> a portable function in ``picklehooks._hub``;
* :mod:`~picklehooks.serialize.package`: hooked models through ``torch.package``;
* :mod:`~picklehooks.serialize.hookdoc`: hooks as a JSON document in ``config.json`` or safetensors metadata.

Decoding and loading names is the pinned shim's job (:mod:`picklehooks._shim`),
which saved files need without this folder. Imports only the pinned runtime.
"""
