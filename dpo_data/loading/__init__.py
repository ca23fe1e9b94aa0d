"""Loading a dataset: epoch order -> bin packing -> steps per rank -> packed micro-batches -> the stateful loader."""
