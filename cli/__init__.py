"""Click commands, thin: parse options, call the library, print."""
