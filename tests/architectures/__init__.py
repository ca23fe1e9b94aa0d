"""The architecture zoo: every attention path exact per pair, the probe, the unpacked path, MoE, the parity guard."""
