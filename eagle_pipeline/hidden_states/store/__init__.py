"""What a hidden-state shard holds on disk and how it is read: the shard format, its fingerprint and index, the recorded head, FP8 storage, and reads of the merged table."""
