"""Tiny Hugging Face models built from configs (no downloads), with the keyword inputs HF code uses.

Each is small enough to compile in well under a minute on two cores. They
are the "models nobody here wrote" of the faithfulness tests: keyword calls,
tied weights, rotary embeddings, encoder-decoder cross attention, patches.
"""

from __future__ import annotations

import torch

transformers = None  # imported on first use: tests that don't need it stay fast


def _tf():
    global transformers
    if transformers is None:
        import transformers as tf

        transformers = tf
    return transformers


def build(name: str, *, reference: bool = False) -> torch.nn.Module:
    """The model ``name``; ``reference``: the same model as plain hooks can watch it, where that
    differs (the ResNet without in-place activations, which would drop a view's gradient hook)."""
    if name == "resnet":
        return TinyResNet(inplace=not reference).eval()
    tf = _tf()
    torch.manual_seed(0)
    small = {"attn_implementation": "eager"}
    if name == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=32, **small))
    elif name == "bert":
        model = tf.BertModel(tf.BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=16,
                                           intermediate_size=32, vocab_size=50, max_position_embeddings=32, **small))
    elif name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                   hidden_size=16, intermediate_size=32, vocab_size=50,
                                                   max_position_embeddings=32, **small))
    elif name == "t5":
        model = tf.T5ForConditionalGeneration(tf.T5Config(num_layers=2, num_decoder_layers=2, num_heads=2, d_model=16,
                                                          d_kv=8, d_ff=32, vocab_size=50, decoder_start_token_id=0,
                                                          **small))
    elif name == "hf_resnet":
        # Basic blocks in train mode: each layer ends with a ResNetConvLayer whose activation is an
        # Identity, whose output (its input handed back) the layer changes in place
        # (hidden_state += residual); BatchNorm updates its running statistics.
        model = tf.ResNetForImageClassification(tf.ResNetConfig(layer_type="basic", embedding_size=8,
                                                                hidden_sizes=[8, 16], depths=[1, 1], num_labels=3))
        return model.train()
    elif name == "vit":
        model = tf.ViTModel(tf.ViTConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=16,
                                         intermediate_size=32, image_size=8, patch_size=4, num_channels=3, **small))
    else:
        raise ValueError(name)
    # No KV cache (export can't return one), and the loss named, so HF doesn't log a warning
    # that torch.compile can't trace.
    model.config.use_cache = False
    if name in ("gpt2", "llama"):
        model.loss_type = "ForCausalLM"
    return model.eval()  # no dropout: every form computes the same thing


def inputs(name: str, seed: int = 1) -> dict:
    """The keyword arguments of one training step (HF models are called with keywords); ``seed``: another batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (2, 6), generator=g)
    if name in ("vit", "resnet"):
        return {"pixel_values": torch.randn(2, 3, 8, 8, generator=g)}
    if name == "hf_resnet":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g)}
    if name == "t5":
        return {"input_ids": ids, "labels": torch.randint(0, 50, (2, 5), generator=g)}
    if name == "bert":
        mask = torch.ones_like(ids)
        mask[:, -2:] = 0  # padding, so that every form really builds the mask
        return {"input_ids": ids, "attention_mask": mask}
    return {"input_ids": ids, "labels": ids}


def step_loss(out) -> torch.Tensor:
    """What one training step differentiates: the model's loss, else the mean square of its last hidden state.

    (Not the hidden state's plain sum: after a LayerNorm that is about zero, and so are its gradients.)
    """
    if isinstance(out, dict) and out.get("loss") is not None:
        return out["loss"]
    # Every output is used, so that every form sees the same gradients: a compiled graph
    # hands an unused output's backward zeros where eager hands it nothing.
    parts = [v for v in (out.values() if isinstance(out, dict) else out) if isinstance(v, torch.Tensor)]
    return sum(v.float().pow(2).mean() for v in parts)


NAMES = ["gpt2", "bert", "llama", "t5", "vit", "resnet", "hf_resnet"]


class BasicBlock(torch.nn.Module):
    """A ResNet basic block as torchvision writes it: in-place ReLUs and an in-place residual add
    (``inplace=False``: neither, the same maths)."""

    def __init__(self, channels: int, inplace: bool = True) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.relu = torch.nn.ReLU(inplace=inplace)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(channels)
        self.relu2 = torch.nn.ReLU(inplace=inplace)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.relu2.inplace:
            out += identity
        else:
            out = out + identity
        return self.relu2(out)


class TinyResNet(torch.nn.Module):
    """A torchvision-free ResNet of two basic blocks (torchvision doesn't install beside this torch),
    called like an HF vision model: ``model(pixel_values=...)`` returns a dict with ``logits``."""

    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = torch.nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(4)
        self.relu = torch.nn.ReLU(inplace=inplace)
        self.layer1 = torch.nn.Sequential(BasicBlock(4, inplace), BasicBlock(4, inplace))
        self.head = torch.nn.Conv2d(4, 4, 1)
        self.act = torch.nn.LeakyReLU(0.1, inplace=inplace)
        self.fc = torch.nn.Linear(4, 5)
        with torch.no_grad():  # running statistics that aren't the identity, so BatchNorm does something
            for m in self.modules():
                if isinstance(m, torch.nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.5, 0.5)
                    m.running_var.uniform_(0.5, 1.5)

    def forward(self, pixel_values: torch.Tensor) -> dict:
        x = self.layer1(self.relu(self.bn1(self.conv1(pixel_values))))
        x = self.act(self.head(x))
        return {"logits": self.fc(x.mean(dim=(2, 3)))}
