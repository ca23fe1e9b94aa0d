"""TRL as the peer: its configs translated, its input shapes built, its numbers matched."""
