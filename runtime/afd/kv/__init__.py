"""The paged KV cache (`cache`: blocks, layouts, the allocator) and its size from the device memory (`budget`)."""
