"""peer: everything one stage peer does (RPC service, compute runtime, stash, optimizer, averaging)."""
