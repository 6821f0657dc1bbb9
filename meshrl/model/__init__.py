"""Models and what runs on them: loading by path, the embedded architectures,
generation and its engines, the training-side forward (packing), LoRA, vision
(M-RoPE included), MoE routing replay, losses and optimizers."""
