"""Small factories of models people bring, for ``--model experiments.user_models:<factory>``.

Random weights, nothing downloaded, the smallest sizes that keep each model's structure (its
experts, its encoder and decoder, its attention): what ``bench_user_models.py`` runs through the
documented ``package.module:factory`` path (README, "Your own model"). Run from the repository
root (``experiments`` is then importable), or put the folder on ``PYTHONPATH``.

Each factory takes ``num_classes`` (and ``image_size`` for images), as autoprec passes them, and
returns an ``nn.Module`` describing its input with ``autoprec_input_shape`` (and
``autoprec_vocab_size`` for token ids).
"""

from __future__ import annotations

from torch import nn

SEQ_LEN = 32
VOCAB = 512


def _tokens(module: nn.Module, vocab: int = VOCAB, seq_len: int = SEQ_LEN) -> nn.Module:
    module.autoprec_input_shape = (seq_len,)
    module.autoprec_vocab_size = vocab
    return module


def _decoder(family: str, num_classes: int, **extra: int) -> nn.Module:
    """A decoder-only Hugging Face classifier ``<family>ForSequenceClassification`` from its
    ``<family>Config``: 2 layers, hidden 128, 4 heads (2 key-value heads)."""
    import transformers as tf

    config = getattr(tf, f"{family}Config")(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN * 4,
        num_labels=num_classes,
        pad_token_id=0,
        **extra,
    )
    return _tokens(getattr(tf, f"{family}ForSequenceClassification")(config))


def mixtral(num_classes: int = 10) -> nn.Module:
    """Hugging Face Mixtral: 2 layers, 4 experts, top-2 routing, hidden 128 (experts
    ``gate_up_proj`` [4, 512, 128], ``down_proj`` [4, 128, 256])."""
    return _decoder("Mixtral", num_classes, num_local_experts=4, num_experts_per_tok=2)


def qwen2(num_classes: int = 10) -> nn.Module:
    """Hugging Face Qwen2: 2 layers, hidden 128."""
    return _decoder("Qwen2", num_classes)


def t5(num_classes: int = 10) -> nn.Module:
    """Hugging Face T5 (encoder-decoder): 2 layers each side, d_model 64."""
    import transformers as tf

    config = tf.T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
    )
    return _tokens(tf.T5ForConditionalGeneration(config))


def unet(num_classes: int = 10, image_size: int = 32) -> nn.Module:
    """diffusers' UNet2DModel (its forward needs a ``timestep``): 2 blocks, 32x32."""
    import diffusers

    net = diffusers.UNet2DModel(
        sample_size=image_size,
        in_channels=3,
        out_channels=3,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        layers_per_block=1,
        norm_num_groups=8,
    )
    net.autoprec_input_shape = (3, image_size, image_size)
    return net


def vit_tiny(num_classes: int = 10, image_size: int = 32) -> nn.Module:
    """timm's ``vit_tiny_patch16_224`` at ``image_size`` (32: 4 patches of 16x16)."""
    import timm

    net = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=num_classes, img_size=image_size
    )
    net.autoprec_input_shape = (3, image_size, image_size)
    return net


def convnext_tiny(num_classes: int = 10, image_size: int = 32) -> nn.Module:
    """torchvision's ``convnext_tiny`` (28 M parameters) at ``image_size``."""
    import torchvision

    net = torchvision.models.convnext_tiny(num_classes=num_classes)
    net.autoprec_input_shape = (3, image_size, image_size)
    return net


def efficientnet_b0(num_classes: int = 10, image_size: int = 32) -> nn.Module:
    """timm's ``efficientnet_b0`` (depthwise convolutions, squeeze-and-excitation) at
    ``image_size``."""
    import timm

    net = timm.create_model("efficientnet_b0", pretrained=False, num_classes=num_classes)
    net.autoprec_input_shape = (3, image_size, image_size)
    return net
