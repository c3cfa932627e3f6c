"""compression: codecs for tensors that cross the network (no networking here)."""
