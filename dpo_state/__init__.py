"""Identity and persistence: attestations, schemas, checkpoint state. The lowest layer; imports no other project package."""
