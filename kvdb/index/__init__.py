"""What finds archived positions: the prefix trie over sessions, the walk-key sidecar and phrase
search over it, and the semantic tier's chunks, vector index and ranking. Indexes read storage
and derive files beside it; they never write the archive's tables.
"""
