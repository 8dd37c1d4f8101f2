"""Gradient surgery that travels with the model, and Jacobians between two layers.

Shows:

1. ``clamp_grad(module, min, max)``: the gradient flowing back into a module
   (w.r.t. its output) is clamped, so its parameters, and everything before
   it, see at most ``max`` per element.
2. ``zero_param_grad(module, "bias")``: one parameter's gradient is zero
   (a frozen bias, without touching ``requires_grad``).
3. Both are portable hooks: the model is saved with plain ``torch.save`` and a
   fresh process that loads it gets the same surgery (the tensor hooks, which
   PyTorch never pickles, are re-attached by the module hooks); the same
   surgery acts in the scripted and compiled model (through picklehooks' ops).
4. ``vjp(model, x, later, earlier)`` and ``hutchinson_jacobian_norm``: how
   strongly a later layer's output reacts to an earlier one's, checked
   against the exact Jacobian of the sub-network between them.

Synthetic data, CPU, a few seconds.

Run: python examples/09_gradient_surgery_and_jacobians.py
"""

import os
import subprocess
import sys
import tempfile
from collections import OrderedDict

import torch
import torch.nn as nn

from picklehooks.diagnostics.jacobian import hutchinson_jacobian_norm, vjp
from picklehooks.diagnostics.surgery import clamp_grad, zero_param_grad

CHILD = """
import sys, torch
model = torch.load(sys.argv[1], weights_only=False)   # plain torch.load: the hooks come along
x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
model(x).square().sum().backward()
print(f"  encoder.0.weight: max |grad| = {model.encoder[0].weight.grad.abs().max():.3f}")
print(f"  head.bias: grad = {model.head.bias.grad.tolist()}")
"""


def make_model() -> nn.Sequential:
    # Built from torch's own classes, so another process can unpickle it without this file.
    encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
    return nn.Sequential(OrderedDict(encoder=encoder, head=nn.Linear(16, 3)))


def grads(model, x):
    model.zero_grad()
    model(x).square().sum().backward()
    params = dict(model.named_parameters())
    prefix = "_orig_mod." if "_orig_mod.head.bias" in params else ""  # a compiled model's names
    return params[prefix + "encoder.0.weight"].grad.abs().max().item(), params[prefix + "head.bias"].grad.tolist()


def main() -> None:
    torch.manual_seed(0)
    model = make_model()
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))

    w, b = grads(model, x)
    print(f"no surgery:\n  encoder.0.weight: max |grad| = {w:.3f}\n  head.bias: grad = {[round(v, 3) for v in b]}")

    handles = [clamp_grad(model.encoder[0], min=-0.01, max=0.01),  # grad w.r.t. encoder.0's output, clamped
               zero_param_grad(model.head, "bias")]
    w, b = grads(model, x)
    print(f"with clamp_grad(encoder[0], ±0.01) and zero_param_grad(head, 'bias'):\n"
          f"  encoder.0.weight: max |grad| = {w:.3f}\n  head.bias: grad = {b}")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.pt")
        torch.save(model, path)
        print(f"another process, loading {os.path.getsize(path)} bytes with plain torch.load:")
        child = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, check=True)
        print(child.stdout, end="")

    scripted, compiled = torch.jit.script(model), torch.compile(model, fullgraph=True, backend="aot_eager")
    for name, form in (("torch.jit.script", scripted), ("torch.compile", compiled)):
        w_form, b_form = grads(form, x)
        print(f"{name}: the same surgery: {abs(w_form - w) < 1e-6 and b_form == b}")

    for handle in handles:  # the surgery would shape the Jacobians below too: take it off
        handle.remove()
    w, b = grads(model, x)
    print(f"handles removed: encoder.0.weight max |grad| = {w:.3f}, head.bias grad = {[round(v, 3) for v in b]}")

    # Jacobian of head's output w.r.t. encoder.0's output, for one sample.
    x1 = x[:1]
    h = model.encoder[0](x1).detach()
    rest = lambda t: model.head(model.encoder[3](model.encoder[2](model.encoder[1](t))))  # noqa: E731
    exact = torch.autograd.functional.jacobian(rest, h).reshape(3, 16)
    g = vjp(model, x1, "head", "encoder.0")             # ones^T J, shaped like encoder.0's output
    print(f"vjp(head, encoder.0) matches ones^T J: {torch.allclose(g, exact.sum(0, keepdim=True), atol=1e-6)}")
    print(f"||J||_F exact: {torch.linalg.matrix_norm(exact):.4f}")
    for samples in (16, 256):
        estimate, stderr = hutchinson_jacobian_norm(model, x1, "head", "encoder.0", samples=samples)
        print(f"  Hutchinson, {samples:3d} Rademacher probes: {estimate:.4f} ± {stderr:.4f}")


if __name__ == "__main__":
    main()
