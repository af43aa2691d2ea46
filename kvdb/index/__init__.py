"""What finds archived positions: the prefix trie over sessions, the walk-key sidecar and phrase
search over it, and semantic search over de-quantized keys. Indexes read storage and derive
files beside it; they never write the archive's tables.
"""
