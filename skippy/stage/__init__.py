"""A stage of a split as a node reports it to its coordinator (the ready report's descriptor)."""
