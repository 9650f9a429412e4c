"""The model table: tiny configs of ``transformers`` models (random weights, nothing downloaded),
each with keyword example inputs that include the targets, so that the model computes its own
loss (Hugging Face's convention, which ``remat.compile`` follows with ``loss_fn=None``).

Used by ``tests/models`` and ``docs/gen_models.py``. Batches are chosen so that activations
dominate the unconstrained peak (a 50% budget is then feasible)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class ZooModel:
    """One row of the table: ``build()`` gives a fresh model (seeded) and its keyword inputs."""

    name: str
    hf_class: str
    build: Callable[[], tuple[torch.nn.Module, dict[str, torch.Tensor]]]


def _ids(vocab: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape)


def _gpt2():
    import transformers as tf

    cfg = tf.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return tf.GPT2LMHeadModel(cfg), dict(input_ids=_ids(256, 4, 64), labels=_ids(256, 4, 64))


def _bert():
    import transformers as tf

    cfg = tf.BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, num_labels=4, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return (tf.BertForSequenceClassification(cfg),
            dict(input_ids=_ids(256, 4, 64), attention_mask=torch.ones(4, 64, dtype=torch.long), labels=_ids(4, 4)))


def _llama():
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    return tf.LlamaForCausalLM(cfg), dict(input_ids=_ids(256, 4, 64), labels=_ids(256, 4, 64))


def _t5():
    import transformers as tf

    cfg = tf.T5Config(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    return tf.T5ForConditionalGeneration(cfg), dict(input_ids=_ids(256, 4, 48), labels=_ids(256, 4, 32))


def _vit():
    import transformers as tf

    cfg = tf.ViTConfig(image_size=32, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=4,
                       num_attention_heads=4, intermediate_size=64, num_labels=10, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    return tf.ViTForImageClassification(cfg), dict(pixel_values=torch.randn(4, 3, 32, 32), labels=_ids(10, 4))


def _resnet():
    import transformers as tf

    cfg = tf.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[16, 32], depths=[3, 2], layer_type="basic",
                          num_labels=10)
    return tf.ResNetForImageClassification(cfg), dict(pixel_values=torch.randn(8, 3, 64, 64), labels=_ids(10, 8))


def _convnext():
    import transformers as tf

    cfg = tf.ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[16, 32], depths=[2, 2], num_labels=10,
                            drop_path_rate=0.0)
    return tf.ConvNextForImageClassification(cfg), dict(pixel_values=torch.randn(8, 3, 64, 64), labels=_ids(10, 8))


def _segformer():
    import transformers as tf

    # Semantic segmentation: the loss is cross-entropy over every pixel of the upsampled logits
    # ([N, C, H, W] against [N, H, W] labels, ATen's nll_loss2d), with an ignored label value.
    cfg = tf.SegformerConfig(num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                             hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
                             mlp_ratios=[2, 2], decoder_hidden_size=32, num_labels=5, drop_path_rate=0.0,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
                             semantic_loss_ignore_index=255)
    labels = _ids(5, 4, 64, 64)
    labels[:, :4] = 255  # a border the loss ignores
    return tf.SegformerForSemanticSegmentation(cfg), dict(pixel_values=torch.randn(4, 3, 64, 64), labels=labels)


def _mixtral():
    import transformers as tf

    # Mixture of experts: each token's top-2 of 4 experts (topk), the token-expert pairs grouped by
    # expert (sort, histc), one grouped matmul per projection, rows put back in token order (index_put).
    cfg = tf.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64, use_cache=False)
    return tf.MixtralForCausalLM(cfg), dict(input_ids=_ids(256, 8, 32), labels=_ids(256, 8, 32))


def _qwen2_moe():
    import transformers as tf

    # Mixture of experts with a shared expert beside the routed ones (and its sigmoid gate).
    cfg = tf.Qwen2MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                            use_cache=False)
    return tf.Qwen2MoeForCausalLM(cfg), dict(input_ids=_ids(256, 4, 32), labels=_ids(256, 4, 32))


def _olmoe():
    import transformers as tf

    cfg = tf.OlmoeConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=64, use_cache=False, pad_token_id=0, bos_token_id=None,
                         eos_token_id=None)
    return tf.OlmoeForCausalLM(cfg), dict(input_ids=_ids(256, 4, 32), labels=_ids(256, 4, 32))


def _vitmae():
    import transformers as tf

    # Masked autoencoder: 75% of the patches masked at random (argsort of noise, the kept patches
    # gathered, the decoder's sequence restored by another gather). The noise is an input here so
    # that eager PyTorch masks the same patches; without it remat draws the noise from its own seed
    # (tests/models/test_routing.py).
    cfg = tf.ViTMAEConfig(image_size=32, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, intermediate_size=64, decoder_hidden_size=32,
                          decoder_num_hidden_layers=1, decoder_num_attention_heads=4, decoder_intermediate_size=64,
                          mask_ratio=0.75, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return tf.ViTMAEForPreTraining(cfg), dict(pixel_values=torch.randn(16, 3, 32, 32), noise=torch.rand(16, 64))


def _seeded(make: Callable) -> Callable[[], tuple[torch.nn.Module, dict[str, torch.Tensor]]]:
    def build():
        torch.manual_seed(0)
        model, inputs = make()
        return model.train(), inputs
    return build


MODELS: list[ZooModel] = [
    ZooModel("gpt2", "GPT2LMHeadModel", _seeded(_gpt2)),
    ZooModel("bert", "BertForSequenceClassification", _seeded(_bert)),
    ZooModel("llama", "LlamaForCausalLM", _seeded(_llama)),
    ZooModel("t5", "T5ForConditionalGeneration", _seeded(_t5)),
    ZooModel("vit", "ViTForImageClassification", _seeded(_vit)),
    ZooModel("resnet", "ResNetForImageClassification", _seeded(_resnet)),
    ZooModel("convnext", "ConvNextForImageClassification", _seeded(_convnext)),
    ZooModel("segformer", "SegformerForSemanticSegmentation", _seeded(_segformer)),
    ZooModel("mixtral", "MixtralForCausalLM", _seeded(_mixtral)),
    ZooModel("qwen2_moe", "Qwen2MoeForCausalLM", _seeded(_qwen2_moe)),
    ZooModel("olmoe", "OlmoeForCausalLM", _seeded(_olmoe)),
    ZooModel("vitmae", "ViTMAEForPreTraining", _seeded(_vitmae)),
]
