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


def build(name: str) -> torch.nn.Module:
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


def inputs(name: str) -> dict:
    """The keyword arguments of one training step (HF models are called with keywords)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (2, 6), generator=g)
    if name == "vit":
        return {"pixel_values": torch.randn(2, 3, 8, 8, generator=g)}
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


NAMES = ["gpt2", "bert", "llama", "t5", "vit"]
