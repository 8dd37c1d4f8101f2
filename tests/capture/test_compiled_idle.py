"""A compiled instrumented model that isn't recording runs the plain model's graph (#38 item 1).

Dynamo guards on whether anything records (``_state.SWITCH``), so a compiled model has one graph
for each state: the idle one holds no picklehooks op, the recording one every op. After one call in
each, toggling recording, fresh batches and the training callbacks' ``every_n_steps`` compile
nothing more. ``torch.export`` keeps every op whatever the state it exports in. Ground truth for the
records is the same instrumented model run eagerly; for the graphs, what a backend is handed.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn

import picklehooks


class _Graphs:
    """A Dynamo backend (the ``eager`` one) that keeps the picklehooks ops of each graph it is handed."""

    def __init__(self) -> None:
        self.ops: list[list[str]] = []

    def __call__(self, gm, example_inputs):
        self.ops.append([str(n.target) for n in gm.graph.nodes if "picklehooks" in str(n.target)])
        return gm.forward


class _SharedOnTwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared, self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.shared(self.a(x)) + self.shared(self.b(x)) * 2)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _step(model, seed: int, recording: bool):
    model.zero_grad(set_to_none=True)  # param_grad records .grad, which would add up over the steps
    torch.manual_seed(seed)
    with picklehooks.record() if recording else contextlib.nullcontext() as log:
        model(torch.randn(2, 3, requires_grad=True)).sum().backward()
    return log


@pytest.mark.parametrize("first", ["idle", "recording"])
@pytest.mark.parametrize("capture", [None, "all", ("grad_output",)], ids=["defaults", "all", "grad_only"])
def test_idle_graph_holds_no_op_and_toggling_never_recompiles(first, capture, fresh_dynamo):
    model = _SharedOnTwoBranches()
    eager = copy.deepcopy(model)
    kw = {} if capture is None else {"capture": capture}
    picklehooks.instrument(model, **kw)
    picklehooks.instrument(eager, **kw)
    graphs = _Graphs()
    compiled = torch.compile(model, fullgraph=True, backend=graphs)
    order = [False, True] if first == "idle" else [True, False]
    for recording in order:  # one warm-up step in each state
        _step(compiled, 0, recording)
    assert len(graphs.ops) == 2
    idle_ops, recording_ops = graphs.ops if first == "idle" else graphs.ops[::-1]
    assert idle_ops == [] and recording_ops, graphs.ops
    logs = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(1, 13):
            log = _step(compiled, seed, seed % 3 == 0)
            if log is not None:
                logs.append((seed, log))
    assert len(graphs.ops) == 2
    for seed, log in logs:
        want = _step(eager, seed, True)
        assert sorted(r.key for r in log.records) == sorted(r.key for r in want.records)
        for got, expected in zip(sorted(log.records, key=lambda r: r.key), sorted(want.records, key=lambda r: r.key)):
            assert got.stats["shape"] == expected.stats["shape"]
            assert got.stats["norm"] == pytest.approx(expected.stats["norm"], rel=1e-5, abs=1e-6), got.key


def test_export_keeps_its_ops_when_exported_while_idle(fresh_dynamo):
    model = _SharedOnTwoBranches()
    picklehooks.instrument(model, capture=("input", "output"))
    x = torch.randn(2, 3)
    program = torch.export.export(model, (x,))
    ops = [str(n.target) for n in program.graph.nodes if "picklehooks" in str(n.target)]
    assert ops
    with picklehooks.record() as log:
        program.module()(x)
    assert {r.module for r in log.records} == {"a", "b", "shared", "act"}


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        return self.body(x)


def test_lightning_callback_every_n_steps_on_a_compiled_model_compiles_twice(tmp_path, fresh_dynamo):
    L = pytest.importorskip("lightning")
    from picklehooks.integrations.lightning import PicklehooksCallback

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _Tiny()
            # Held outside the module tree, so the layers keep their names.
            self.__dict__["graphs"] = _Graphs()
            self.__dict__["run"] = torch.compile(self.net, fullgraph=True, backend=self.graphs)

        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 3:  # steps 0..2 compiled both graphs (idle, recorded)
                torch._dynamo.config.error_on_recompile = True
            x, y = batch
            loss = nn.functional.mse_loss(self.run(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    callback = PicklehooksCallback(modules=["net.body.0", "net.body.2"], capture=("output", "grad_output"),
                                   every_n_steps=2)
    net = Net()
    trainer = L.Trainer(max_steps=12, callbacks=[callback], logger=False, log_every_n_steps=2,
                        default_root_dir=str(tmp_path), enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1, enable_checkpointing=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(net, torch.utils.data.DataLoader(data, batch_size=4))
    finally:
        torch._dynamo.config.error_on_recompile = False
    per_step: dict = {}
    for r in callback.recorded.records:
        per_step[r.step] = per_step.get(r.step, 0) + 1
    assert len(per_step) >= 5 and len(set(per_step.values())) == 1 and min(per_step.values()) == 4
    assert len(net.graphs.ops) == 2 and sorted(map(len, net.graphs.ops))[0] == 0


def test_transformers_callback_every_n_steps_on_a_compiled_model_compiles_twice(tmp_path, fresh_dynamo):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from picklehooks.integrations.transformers import PicklehooksCallback

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(0, 100, (12,), generator=g), "labels": torch.randint(0, 100, (12,), generator=g)}
            for _ in range(32)]

    class Steady(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 3:  # steps 1..3 compiled both graphs (idle, recorded at 2)
                torch._dynamo.config.error_on_recompile = True

    callback = PicklehooksCallback(modules=["transformer.h.0.mlp", "transformer.h.1.attn"],
                                   capture=("output", "grad_output"), every_n_steps=2)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=10,
                                          learning_rate=0.1, optim="sgd", report_to=[], logging_steps=2,
                                          use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
                                          torch_compile=True, torch_compile_backend="eager")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[Steady(), callback])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    finally:
        torch._dynamo.config.error_on_recompile = False
    per_step: dict = {}
    for r in callback.recorded.records:
        per_step[r.step] = per_step.get(r.step, 0) + 1
    assert sorted(per_step) == [2, 4, 6, 8, 10] and len(set(per_step.values())) == 1


def test_a_plain_copy_compiled_first_is_named_in_the_warning(fresh_dynamo):
    """Dynamo doesn't guard on module hooks, so an instrumented copy compiled after a plain model of
    its class runs the plain graph and records nothing: record() warns with the fix, and after
    torch._dynamo.reset() the copy records what the plain model computes."""
    plain = _SharedOnTwoBranches()
    hooked = copy.deepcopy(plain)
    picklehooks.instrument(hooked, capture="output")
    x = torch.randn(2, 3)
    want = plain(x)
    torch.compile(plain, fullgraph=True)(x)
    with pytest.warns(UserWarning, match=r"torch\._dynamo\.reset\(\) before compiling"):
        with picklehooks.record() as log:
            torch.compile(hooked, fullgraph=True)(x)
    assert log.records == []
    torch._dynamo.reset()
    with picklehooks.record() as log:
        torch.compile(hooked, fullgraph=True)(x)
    (act,) = [r for r in log.records if r.module == "act"]
    assert act.stats["mean"] == pytest.approx(want.mean().item(), rel=1e-5)


def test_a_plain_copy_compiled_after_takes_over_unless_dynamo_guards_on_hooks(fresh_dynamo):
    """The other order: an instrumented model compiled and recording, then a plain copy of its class
    compiled, runs the plain graph from then on and records nothing (record() warns, naming the
    setting). With torch._dynamo.config.skip_nnmodule_hook_guards off, each keeps its own graph: the
    instrumented model records what the plain model computes, after the copy is compiled too."""
    plain = _SharedOnTwoBranches()
    hooked = copy.deepcopy(plain)
    picklehooks.instrument(hooked, capture="output")
    x = torch.randn(2, 3)
    want = plain(x)
    compiled = torch.compile(hooked, fullgraph=True)
    with picklehooks.record() as log:
        compiled(x)
    assert [r.module for r in log.records if r.module == "act"] == ["act"]
    torch.compile(plain, fullgraph=True)(x)
    with pytest.warns(UserWarning, match=r"skip_nnmodule_hook_guards = False before compiling either"):
        with picklehooks.record() as log:
            compiled(x)
    assert log.records == []
    torch._dynamo.reset()
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        compiled = torch.compile(hooked, fullgraph=True)
        with picklehooks.record():
            compiled(x)
        torch.compile(plain, fullgraph=True)(x)
        with picklehooks.record() as log:
            compiled(x)
    (act,) = [r for r in log.records if r.module == "act"]
    assert act.stats["mean"] == pytest.approx(want.mean().item(), rel=1e-5)
