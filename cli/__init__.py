"""Click commands, thin: parse options, call the library, print."""

import atexit
import gc

# At exit, after every atexit handler registered later (W&B, logging, loader workers, temporary directories: they
# run first), freeze the heap: the interpreter's final garbage collections then skip the millions of objects torch
# and transformers allocate, about 1 s of every command's exit (docs/benchmarks.md, "Process exit"). Objects are
# still freed by their reference counts; only cycles left at exit go uncollected, as the OS frees them anyway.
atexit.register(gc.freeze)
