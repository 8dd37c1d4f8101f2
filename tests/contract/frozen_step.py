"""The step every frozen artifact of tests/data/frozen_v2/ recorded, and how a process loads each one.

Shared by tests/data/make_frozen_v2.py (which recorded the expected records with it, in a fresh
process running the code being frozen) and tests/contract/test_wire_contract.py (which runs it
again, in a fresh process, with the code of the day). Public API only: the step must mean the
same thing to every version.
"""

#: How a process loads each artifact: torch's own loaders.
LOADERS = {
    "save": "torch.load(path, weights_only=False)",
    "package": "PackageImporter(path).load_pickle('model', 'model.pkl')",
    "script": "torch.jit.load(path)",
    "export": "torch.export.load(path).module()",
}

#: One forward and backward step under record(), and what comes back of it (format with ``load=``).
STEP = """
import sys, torch
import picklehooks
from torch.package import PackageImporter
path, x_path, out_path = sys.argv[1:4]
model = {load}
x = torch.load(x_path, weights_only=True).clone().requires_grad_()
model.zero_grad(set_to_none=True)
with picklehooks.record() as log:
    output = model(x)
    output.square().sum().backward()
records = [{{"key": r.key, "step": r.step, "shape": tuple(r.shape), "dtype": r.dtype, "value": r.value,
            "stats": {{k: v for k, v in r.stats.items() if k not in ("shape", "dtype")}}}} for r in log.records]
torch.save({{"records": records, "output": output.detach(), "input_grad": x.grad,
            "param_grads": {{n: p.grad for n, p in model.named_parameters()}},
            "picklehooks": picklehooks.__file__}}, out_path)
"""
