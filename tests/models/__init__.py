"""Every model the tests share, in one place, by family (import the family you need).

* :mod:`tests.models.small`: small models, each exercising a different hook shape (MLP, CNN,
  attention, a transformer, a module called twice, an LSTM with a tuple state);
* :mod:`tests.models.faults`: models with a planted fault whose diagnosis is known (NaN,
  overflow, dead units, saturation, conflicting heads), for the diagnostics tests and examples;
* :mod:`tests.models.odd`: shapes that once made a graph drop, merge, reorder or alias a tap;
* :mod:`tests.models.hf`: tiny Hugging Face models built from configs (no downloads), and a
  torchvision-style ResNet with in-place activations.

Each family with several models names them in ``NAMES`` and builds them with ``build(name)``;
``inputs(name)`` gives the arguments to call one with. Hooks shared by the tests are in
:mod:`tests.hooks`.
"""
