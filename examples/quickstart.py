"""Quickstart (placeholder until inspect() lands)."""
print("memtorch quickstart")
