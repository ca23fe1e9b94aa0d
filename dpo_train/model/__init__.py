"""The model room: loading the policy (with the attention path that fits it), LoRA, and the bundled SmolLM2."""
