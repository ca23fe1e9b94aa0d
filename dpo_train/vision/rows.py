"""One packed micro-batch of vision-language pairs: the loader's (`dpo_data.loading.vision`), named for the room."""

from __future__ import annotations

from dpo_data.loading.vision import VisionPair, check_pair, pack_vision

__all__ = ["VisionPair", "check_pair", "pack_vision"]
