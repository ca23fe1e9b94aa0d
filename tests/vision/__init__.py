"""Vision-language tests: tiny random VLMs, packed rows scored exactly."""
